"""`python -m speechattn.prune heads=HEADS_JSON fraction=0.3 [upstream=PATH] [out=PATH]`.

Actual pruning: writes an upstream.pt without the heads that a head analysis
(`python -m speechattn.analyze heads`) masks at the pruning point nearest to `fraction`. All
logic is in `speechattn.model.pruning` (`prune_from_heads`, `prune_upstream`).
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

import speechattn


@hydra.main(version_base="1.3", config_path=str(speechattn.CONFIG_DIR), config_name="prune")
def main(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    from speechattn.model.pruning import prune_from_heads
    from speechattn.tasks.heads_result import read_heads

    out = cfg.out or Path(HydraConfig.get().runtime.output_dir) / "upstream.pt"
    path = prune_from_heads(read_heads(cfg.heads), cfg.fraction, out, cfg.upstream)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
