"""Actual pruning job: an upstream without the heads that a head analysis masks, at the
heads.json pruning point nearest to `fraction` (`speechattn.model.pruning` prunes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig

from speechattn.errors import is_number, require
from speechattn.model.pruning import prune_from_heads
from speechattn.tasks.records import read_heads


@dataclass
class PruneConfig:
    """`python -m speechattn.prune`: which heads to remove, from which upstream, to where."""

    # heads.json (or its folder) written by `python -m speechattn.analyze heads`
    heads: str = MISSING
    # the pruning point: fraction of all L x h heads masked (the curve's nearest point)
    fraction: float = MISSING
    upstream: str | None = None  # None: the analysed upstream (its sha256 is checked either way)
    out: str | None = None  # None: <run dir>/upstream.pt


def run(cfg: DictConfig) -> dict[str, Any]:
    """Prune per `conf/prune.yaml`; returns {"upstream": the written path}."""
    from hydra.core.hydra_config import HydraConfig

    ok = is_number(cfg.fraction) and 0 <= cfg.fraction <= 1
    require(ok, "fraction", cfg.fraction, "a number in [0, 1] (share of all L x h heads pruned)")
    out = cfg.out or Path(HydraConfig.get().runtime.output_dir) / "upstream.pt"
    path = prune_from_heads(read_heads(cfg.heads), cfg.fraction, out, cfg.upstream)
    print(f"wrote {path}", flush=True)
    return {"upstream": str(path)}
