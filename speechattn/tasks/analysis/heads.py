"""Head importance, ablation and pruning (Michel et al., 2019, "Are Sixteen Heads Really Better
than One?") for any attention variant (docs/analysis.md).

Every attention multiplies head h's output by xi_h before its output projection,
MHAtt(x) = sum_h xi_h Att_h(x), with xi a (L, h) tensor (one row per depth, also with shared
weights). Importance I_{l,h} = E_x |dL(x)/dxi_{l,h}| at xi = 1 (or the current pruning mask),
the absolute value taken per utterance (Michel et al.) or per batch (`per="batch"`: cheaper,
but opposite signs within a batch cancel), each depth's row divided by its L2 norm. Ablation:
the metric with one head masked, with only one head of a depth kept, and with a depth masked.
Pruning: heads masked in increasing normalised importance, `step` of all heads at a time,
importance optionally re-estimated after each step. L and the metric are an `Objective`
(`objectives.py`); the model runs in eval mode, so every number is deterministic.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from speechattn.errors import ConfigError, SpeechattnError
from speechattn.tasks.analysis.objectives import (  # the objectives are re-exported here
    PER_CHOICES,
    LabelledBatch,
    Objective,
    PretrainObjective,
    ProbeObjective,
)
from speechattn.utils import track

# ----------------------------------------------------------------------------- config


@dataclass
class ImportanceConfig:
    per: str = "utterance"  # abs of the gradient per utterance (Michel et al.) | per batch

    def __post_init__(self) -> None:
        if self.per not in PER_CHOICES:
            raise ConfigError(f"importance.per must be one of {PER_CHOICES}, got {self.per!r}")


@dataclass
class AblationConfig:
    single: bool = True  # mask one head at a time: L*h evaluations
    keep_only: bool = True  # keep only head h of depth l: L*h evaluations
    layer: bool = True  # mask a whole depth: L evaluations


@dataclass
class PruningConfig:
    enabled: bool = True
    step: float = 0.1  # fraction of all L*h heads masked per step (Michel et al.: 10 %)
    recompute: bool = False  # re-estimate importance at the current mask after each step
    keep_one_per_layer: bool = False  # never mask the last head of a depth

    def __post_init__(self) -> None:
        if not 0.0 < self.step <= 1.0:
            raise ConfigError(f"pruning.step must be in (0, 1], got {self.step}")


@dataclass
class HeadsConfig:
    """The analyses to run; `conf/analyze.yaml` mirrors it (`importance`, `ablation`, `pruning`)."""

    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    pruning: PruningConfig = field(default_factory=PruningConfig)


# ----------------------------------------------------------------------------- analyses


def head_gradient(objective: Objective, unit: Any, head_mask: Tensor) -> Tensor | None:
    """Signed dL/dxi (L, h) of one unit at `head_mask`; None when the unit scores nothing."""
    xi = head_mask.detach().clone().requires_grad_(True)
    loss = objective.loss(unit, xi)
    if loss is None:
        return None
    (grad,) = torch.autograd.grad(loss, xi)
    return grad


@torch.no_grad()
def evaluate(objective: Objective, head_mask: Tensor | None = None) -> float:
    """The metric over the whole subset with head mask (L, h) (None: all heads)."""
    head_mask = objective.ones() if head_mask is None else head_mask.to(objective.ones())
    total = count = 0.0
    for batch in objective.batches:
        s, c = objective.score(batch, head_mask)
        total, count = total + s, count + c
    if count == 0:
        raise ConfigError("nothing in the data subset is scored (no chosen frames / labels)")
    return total / count


def normalize_per_depth(raw: Tensor, active: Tensor | None = None) -> Tensor:
    """Divide each depth's row of raw (L, h) by its L2 norm; heads with `active` (L, h) False
    count as 0 (already pruned). A row of zeros stays zero."""
    scores = raw if active is None else raw * active.to(raw.dtype)
    norm = torch.linalg.vector_norm(scores, dim=1, keepdim=True)  # (L, 1)
    return scores / norm.clamp_min(torch.finfo(raw.dtype).tiny)


@dataclass
class Importance:
    raw: Tensor  # (L, h) E|dL/dxi|
    normalized: Tensor  # (L, h) raw / ||raw_l||_2 per depth
    signed: Tensor  # (L, h) E[dL/dxi], for diagnostics
    per: str  # "utterance" | "batch"
    units: int  # units averaged over

    def order(self) -> list[tuple[int, int]]:
        """(depth, head) in increasing normalised importance (ties: depth, then head)."""
        flat = self.normalized.flatten().cpu()
        idx = torch.argsort(flat, stable=True).tolist()
        h = self.normalized.shape[1]
        return [(i // h, i % h) for i in idx]


def head_importance(
    objective: Objective,
    per: str = "utterance",
    head_mask: Tensor | None = None,
    progress: bool = False,
) -> Importance:
    """I = E_unit |dL/dxi| at `head_mask` (default all ones), normalised per depth.

    Heads masked in `head_mask` get importance 0 in `normalized` (they are already pruned).
    """
    head_mask = objective.ones() if head_mask is None else head_mask.to(objective.ones())
    acc_abs = torch.zeros_like(head_mask)
    acc = torch.zeros_like(head_mask)
    n = 0
    total = objective.num_units(per) if progress else None
    for unit in track(objective.units(per), f"importance (per {per})", total, progress):
        grad = head_gradient(objective, unit, head_mask)
        if grad is None:
            continue  # nothing scored in this unit: it carries no evidence
        acc_abs += grad.abs()
        acc += grad
        n += 1
    if n == 0:
        raise ConfigError("no unit of the data subset has a scored frame or label")
    raw = acc_abs / n
    return Importance(raw, normalize_per_depth(raw, head_mask != 0), acc / n, per, n)


@dataclass
class Ablation:
    base: float
    single: Tensor | None = None  # (L, h) metric with head (l, h) masked
    keep_only: Tensor | None = None  # (L, h) metric with only head h kept in depth l
    layer: Tensor | None = None  # (L,) metric with depth l fully masked

    def delta(self, name: str) -> Tensor | None:
        value = getattr(self, name)
        return None if value is None else value - self.base


def ablate(
    objective: Objective,
    single: bool = True,
    keep_only: bool = True,
    layer: bool = True,
    base: float | None = None,
    progress: bool = False,
) -> Ablation:
    """Metric when masking one head, keeping one head per depth, or masking one depth."""
    ones = objective.ones()
    L, h = ones.shape
    out = Ablation(evaluate(objective, ones) if base is None else base)
    shapes = {"single": (L, h), "keep_only": (L, h), "layer": (L,)}
    jobs: list[tuple[str, tuple[int, ...]]] = []
    for kind, wanted in zip(shapes, (single, keep_only, layer), strict=True):
        if wanted:
            setattr(out, kind, torch.empty(shapes[kind], dtype=torch.float64))
            jobs += [(kind, index) for index in itertools.product(*map(range, shapes[kind]))]
    for kind, index in track(jobs, "ablation", len(jobs), progress):
        mask = ones.clone()
        if kind != "single":  # keep_only, layer: depth index[0] masked
            mask[index[0]] = 0.0
        if kind != "layer":  # single: head index masked; keep_only: it alone kept
            mask[index] = float(kind == "keep_only")
        getattr(out, kind)[index] = evaluate(objective, mask)
    return out


def prune_schedule(total: int, step: float, cap: int | None = None) -> list[int]:
    """Heads masked at each point: round(k * step * total) for k = 0, 1, ... up to `total`
    (or `cap`), duplicates dropped; always starts at 0 and ends at min(total, cap)."""
    cap = total if cap is None else min(cap, total)
    steps = math.ceil(1.0 / step - 1e-9)
    counts = [min(cap, math.floor(k * step * total + 0.5)) for k in range(steps + 1)]
    counts.append(cap)
    return sorted(set(counts))


def next_heads(
    scores: Tensor, mask: Tensor, count: int, keep_one_per_layer: bool = False
) -> list[tuple[int, int]]:
    """The `count` unmasked heads of lowest score (L, h) to mask next (ties: depth, head);
    with `keep_one_per_layer`, a depth's last unmasked head is never chosen."""
    L, h = scores.shape
    left = (mask != 0).sum(dim=1).tolist()  # unmasked heads per depth
    picked: list[tuple[int, int]] = []
    for i in torch.argsort(scores.flatten().cpu(), stable=True).tolist():
        if len(picked) == count:
            break
        d, k = divmod(i, h)
        if mask[d, k] == 0 or (keep_one_per_layer and left[d] <= 1):
            continue
        picked.append((d, k))
        left[d] -= 1
    return picked


@dataclass
class PruningPoint:
    num_masked: int
    fraction: float  # num_masked / (L * h)
    metric: float
    newly_masked: list[tuple[int, int]]  # heads masked at this step (depth, head)
    mask: Tensor  # (L, h) 1 = kept, 0 = masked


def pruning_curve(
    objective: Objective,
    importance: Importance,
    step: float = 0.1,
    recompute: bool = False,
    keep_one_per_layer: bool = False,
    base: float | None = None,
    progress: bool = False,
) -> list[PruningPoint]:
    """Mask heads in increasing order of normalised importance, `step` of all heads at a time.

    The first point is the unpruned model; the last has every head masked, or one head left
    per depth with `keep_one_per_layer`. With `recompute`, importance is re-estimated (same
    `per`) at the current mask before choosing each step's heads.
    """
    mask = objective.ones()
    L, h = mask.shape
    cap = L * h - L if keep_one_per_layer else L * h
    schedule = prune_schedule(L * h, step, cap)
    first = evaluate(objective, mask) if base is None else base
    points = [PruningPoint(0, 0.0, first, [], mask.clone())]
    scores = importance.normalized
    for target in track(schedule[1:], "pruning", len(schedule) - 1, progress):
        if recompute:
            scores = head_importance(objective, importance.per, mask).normalized
        chosen = next_heads(scores, mask, target - points[-1].num_masked, keep_one_per_layer)
        for d, k in chosen:
            mask[d, k] = 0.0
        n = int((mask == 0).sum())
        points.append(PruningPoint(n, n / (L * h), evaluate(objective, mask), chosen, mask.clone()))
    return points


@dataclass
class HeadAnalysis:
    """Everything `analyze_heads` measured (plain tensors; `heads_result` serialises it)."""

    metric_name: str
    higher_is_better: bool
    base_metric: float
    importance: Importance
    ablation: Ablation
    pruning: list[PruningPoint]
    subset: dict[str, int]
    runtime_s: dict[str, float]


class NonFiniteMetricError(SpeechattnError, ValueError):
    """The metric of the unmasked model is NaN/inf."""


def analyze_heads(
    objective: Objective, config: HeadsConfig | None = None, progress: bool = False
) -> HeadAnalysis:
    """Importance, ablation and the pruning curve of one objective, as configured."""
    import time

    config = config or HeadsConfig()
    times: dict[str, float] = {}
    t = time.perf_counter()
    base = evaluate(objective)
    if not math.isfinite(base):  # every importance, ablation and pruning point would be NaN
        raise NonFiniteMetricError(
            f"the unmasked model's {objective.metric_name} is {base}: the upstream's hidden "
            f"states are NaN/inf (a diverged pretraining?), so no head can be scored"
        )
    importance = head_importance(objective, config.importance.per, progress=progress)
    times["importance"] = time.perf_counter() - t
    t = time.perf_counter()
    a = config.ablation
    ablation = ablate(objective, a.single, a.keep_only, a.layer, base=base, progress=progress)
    times["ablation"] = time.perf_counter() - t
    t = time.perf_counter()
    p = config.pruning
    points: list[PruningPoint] = []
    if p.enabled:
        points = pruning_curve(
            objective, importance, p.step, p.recompute, p.keep_one_per_layer, base, progress
        )
    times["pruning"] = time.perf_counter() - t
    return HeadAnalysis(
        metric_name=objective.metric_name,
        higher_is_better=objective.higher_is_better,
        base_metric=base,
        importance=importance,
        ablation=ablation,
        pruning=points,
        subset={**objective.subset(), "importance_units": importance.units},
        runtime_s={k: round(v, 3) for k, v in times.items()},
    )


__all__ = [
    "Ablation",
    "AblationConfig",
    "HeadAnalysis",
    "HeadsConfig",
    "Importance",
    "ImportanceConfig",
    "LabelledBatch",
    "NonFiniteMetricError",
    "Objective",
    "PretrainObjective",
    "ProbeObjective",
    "PruningConfig",
    "PruningPoint",
    "ablate",
    "analyze_heads",
    "evaluate",
    "head_gradient",
    "head_importance",
    "next_heads",
    "normalize_per_depth",
    "prune_schedule",
    "pruning_curve",
]
