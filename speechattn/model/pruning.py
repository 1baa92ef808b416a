"""Actual pruning: an `upstream.pt` whose masked heads' parameters are removed, equal to the
source run with that head mask (rules and file records: docs/analysis.md, Actual pruning).

    prune_upstream("upstream.pt", mask, "pruned.pt")       # mask (L, h), 0 = masked
    prune_upstream("upstream.pt", {0: [1, 3]}, "pruned.pt")  # layer -> heads kept
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speechattn.errors import ConfigError, MissingFileError
from speechattn.model.upstream import load_upstream, save_upstream, upstream_sha256, upstream_state

Heads = Mapping[int, Sequence[int]] | Tensor | Sequence[Sequence[float]]


def prune_upstream(
    src: str | Path, heads: Heads, dst: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write to `dst`, atomically, the upstream `src` without the heads `heads` removes: an
    (L, h) head mask (tensor or nested lists, 0 = masked) or {layer: heads to keep}
    (`AALBERT.prune_heads`). `extra` goes into `metadata["pruning"]`."""
    src = Path(src)
    upstream = load_upstream(src)
    model = upstream.model
    if not isinstance(heads, Tensor | Mapping):
        heads = torch.tensor(heads, dtype=torch.float64)
    before = model.get_num_params()
    model.prune_heads(heads)
    c = model.config
    record = {
        "source": str(src.resolve()),
        "source_sha256": upstream_sha256(src),
        "params_before": before,
        "params_after": model.get_num_params(),
        "pruned_heads": {int(j): list(k) for j, k in c.pruned_heads.items()},
        "residual_head_mask": c.residual_head_mask is not None,
        "shared": c.shared,
        **(extra or {}),
    }
    metadata = {**upstream.metadata, "pruning": record}
    state = upstream_state(model, upstream.normalizer, upstream.feature_config, metadata)
    return save_upstream(dst, state)


def pruning_point(heads: Mapping[str, Any], fraction: float) -> dict[str, Any]:
    """The point of a heads.json pruning curve whose fraction of masked heads is nearest to
    `fraction` (ties: the smaller one), as stored: {"num_masked", "fraction", "metric", "mask"}."""
    curve = heads.get("pruning")
    if not curve or not curve.get("points"):
        raise ConfigError(
            "this heads.json has no pruning curve; run `python -m speechattn.analyze heads` "
            "with pruning.enabled=true"
        )
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ConfigError(f"fraction={fraction!r}: must be a number in [0, 1], e.g. fraction=0.3")
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"fraction must be in [0, 1], got {fraction}")
    return min(curve["points"], key=lambda p: (abs(p["fraction"] - fraction), p["fraction"]))


def prune_from_heads(
    heads: Mapping[str, Any], fraction: float, dst: str | Path, upstream: str | Path | None = None
) -> Path:
    """Prune the upstream of a head analysis (`heads`, a read heads.json) at its pruning
    point nearest to `fraction`; `upstream` defaults to the file the analysis ran on and must
    have the sha256 the analysis recorded. Returns the written path."""
    src = Path(upstream or heads["upstream"]).expanduser()
    if not src.exists():
        given = "upstream=" if upstream else "the heads.json's upstream "
        raise MissingFileError(
            f"{given}{src} does not exist; pass upstream=PATH to the upstream.pt the head "
            f"analysis ran on"
        )
    recorded = heads.get("upstream_sha256")
    if recorded and upstream_sha256(src) != recorded:
        raise ConfigError(
            f"{src} is not the upstream this head analysis ran on (sha256 differs from "
            f"{recorded[:12]}... recorded for {heads['upstream']})"
        )
    point = pruning_point(heads, fraction)
    extra = {
        "heads_fraction": point["fraction"],
        "heads_num_masked": point["num_masked"],
        "heads_metric": {heads.get("metric", "metric"): point.get("metric")},
        "heads_task": heads.get("task"),
    }
    return prune_upstream(src, point["mask"], dst, extra)
