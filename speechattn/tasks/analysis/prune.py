"""Actual pruning job: an upstream without the heads that a head analysis masks.

`run(cfg)` reads the heads.json `cfg.heads`, takes its pruning point nearest to `cfg.fraction`
and writes the pruned upstream (`speechattn.model.pruning` does the pruning itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from speechattn.errors import is_number, require
from speechattn.model.pruning import prune_from_heads
from speechattn.tasks.records import read_heads


def run(cfg: DictConfig) -> dict[str, Any]:
    """Prune per `conf/prune.yaml`; returns {"upstream": the written path}."""
    from hydra.core.hydra_config import HydraConfig

    ok = is_number(cfg.fraction) and 0 <= cfg.fraction <= 1
    require(ok, "fraction", cfg.fraction, "a number in [0, 1] (share of all L x h heads pruned)")
    out = cfg.out or Path(HydraConfig.get().runtime.output_dir) / "upstream.pt"
    path = prune_from_heads(read_heads(cfg.heads), cfg.fraction, out, cfg.upstream)
    print(f"wrote {path}", flush=True)
    return {"upstream": str(path)}
