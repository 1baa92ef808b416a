"""`python -m speechattn.downstream task=NAME upstream=PATH|mel [overrides]`.

Evaluates a frozen upstream on one downstream task (SPEC 7) and writes `result.json` to the
Hydra run dir. All logic is in `speechattn.tasks.downstream.run`, which tests call directly.
"""

from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR  # registers the structured configs


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="downstream")
def main(cfg: DictConfig) -> dict[str, Any]:
    from speechattn.tasks.downstream import run

    return run(cfg)


if __name__ == "__main__":
    main()
