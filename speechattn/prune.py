"""`python -m speechattn.prune heads=HEADS_JSON fraction=0.3 [upstream=PATH] [out=PATH]`.

Writes an upstream.pt without the heads a head analysis masks at the pruning point nearest to
`fraction`. The work is `speechattn.tasks.analysis.prune.run(cfg)`; `main` is its Hydra wrapper.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, run_cli
from speechattn.tasks.analysis.prune import run


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="prune")
def main(cfg: DictConfig) -> Any:
    return run_cli(run, cfg)


if __name__ == "__main__":
    main()
