"""`python -m speechattn.downstream task=NAME upstream=PATH|mel [overrides]`.

Evaluates a frozen upstream on one downstream task (docs/downstream.md), writing `result.json`.
The work is `speechattn.tasks.downstream.run(cfg)`; `main` is its Hydra wrapper.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, run_cli
from speechattn.tasks.downstream import run


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="downstream")
def main(cfg: DictConfig) -> Any:
    return run_cli(run, cfg)


if __name__ == "__main__":
    main()
