"""`python -m speechattn.abx upstream=PATH|mel [layer=all|last|N] [split=test] [overrides]`.

ABX discriminability of an upstream's layers, without training (docs/abx.md), written to
`abx.json`. The work is `speechattn.tasks.abx.run(cfg)`; `main` is its Hydra wrapper.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, run_cli
from speechattn.tasks.abx import run


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="abx")
def main(cfg: DictConfig) -> Any:
    return run_cli(run, cfg)


if __name__ == "__main__":
    main()
