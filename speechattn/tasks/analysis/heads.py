"""Head importance, ablation and pruning (Michel et al., 2019, "Are Sixteen Heads Really Better
than One?") for any attention variant (docs/analysis.md): MHAtt(x) = sum_h xi_h Att_h(x) with
xi (L, h), importance I_{l,h} = E_x |dL(x)/dxi_{l,h}| normalised per depth. Per batch
(`per="batch"`) is cheaper, but opposite signs within a batch cancel. The model runs in eval
mode, so every number is deterministic. L and the metric are an `Objective` of xi over a fixed
data subset.

Shape letters: B batch, T 10 ms frames, T' model frames, F' stacked features (3F), D model dim,
L depths, h heads per depth, N hidden layers the probe reads, C classes.
"""

from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from speechattn.errors import ConfigError, SpeechattnError
from speechattn.model.aalbert import AALBERT
from speechattn.model.masking import MaskedBatch, MaskingConfig, corrupt, reconstruction_loss
from speechattn.model.probes import Probe
from speechattn.tasks.downstream.labels import LabelSource, label_source
from speechattn.utils import IGNORE_INDEX, derive_seed, lengths_to_padding_mask, track

PER_CHOICES = ("utterance", "batch")  # the units importance averages |dL/dxi| over
U = TypeVar("U")


class Objective(ABC, Generic[U]):
    """A loss L(unit, xi) to differentiate and a metric to ablate, over `batches` prepared once
    (features on the device, fixed masks); a unit is a batch or one utterance of one."""

    metric_name: str = ""
    higher_is_better: bool = False
    device: torch.device = torch.device("cpu")  # where the batches and the model live
    dtype: torch.dtype = torch.float32  # float64 for finite-difference checks
    frames: int = 0  # valid 10 ms frames in the subset

    def __init__(self, num_layers: int, num_heads: int, batches: list[U]) -> None:
        if not batches:
            raise ConfigError("the data subset is empty: no batches to analyse")
        self.num_layers, self.num_heads, self.batches = num_layers, num_heads, batches

    @abstractmethod
    def split(self, batch: U) -> list[U]:
        """The batch's utterances as units of one, each trimmed to its length."""

    @abstractmethod
    def loss(self, unit: U, head_mask: Tensor) -> Tensor | None:
        """Scalar loss with a graph to `head_mask` (L, h); None when nothing in it is scored."""

    @abstractmethod
    def score(self, unit: U, head_mask: Tensor) -> tuple[float, float]:
        """(sum, count) of the metric over the unit; the metric is sum(sums) / sum(counts)."""

    @abstractmethod
    def scored(self, batch: U) -> int:
        """Items the metric counts in `batch`: chosen model frames, or (frame) labels."""

    def subset(self) -> dict[str, int]:
        """Size of the data subset: batches, utterances, frames (10 ms), scored items."""
        return {
            "batches": len(self.batches),
            "utterances": sum(len(b.lengths) for b in self.batches),  # type: ignore[attr-defined]
            "frames": self.frames,
            "scored": sum(self.scored(b) for b in self.batches),
        }

    def units(self, per: str) -> Iterator[U]:
        if per == "batch":
            yield from self.batches
        elif per == "utterance":
            for batch in self.batches:
                yield from self.split(batch)
        else:
            raise ConfigError(f"per must be one of {PER_CHOICES}, got {per!r}")

    def ones(self) -> Tensor:
        """xi = 1 everywhere: (L, h) in the model's dtype and device."""
        return torch.ones(self.num_layers, self.num_heads, dtype=self.dtype, device=self.device)


class PretrainObjective(Objective[MaskedBatch]):
    """Masked-reconstruction L1 of an AALBERT under masks drawn once per batch from `seed`."""

    metric_name = "l1_loss"

    def __init__(
        self,
        model: AALBERT,
        batches: Iterable[dict[str, Any]],
        masking: MaskingConfig | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.model = _frozen(model, self.device, dtype)
        masking = masking or MaskingConfig()
        prepared, self.frames = [], 0
        for i, batch in enumerate(batches):
            features = batch["features"].to(self.device, dtype)  # (B, T, F)
            lengths = batch["lengths"].to(self.device)  # (B,)
            generator = torch.Generator().manual_seed(derive_seed(seed, "heads-mask", i))
            prepared.append(corrupt(self.model, features, lengths, masking, generator))
            self.frames += int(lengths.sum())
        super().__init__(model.num_layers, model.num_heads, prepared)

    def split(self, batch: MaskedBatch) -> list[MaskedBatch]:
        return batch.utterances()

    def loss(self, unit: MaskedBatch, head_mask: Tensor) -> Tensor | None:
        if not bool(unit.chosen.any()):
            return None  # e.g. an utterance too short for a span: nothing to reconstruct
        return reconstruction_loss(self.model, unit, head_mask)

    def score(self, unit: MaskedBatch, head_mask: Tensor) -> tuple[float, float]:
        if not bool(unit.chosen.any()):
            return 0.0, 0.0
        prediction = self.model.reconstruct(unit.inputs, unit.lengths, head_mask)
        error = (prediction - unit.target).abs()  # (B, T', F')
        weight = unit.chosen[..., None].to(error.dtype)  # (B, T', 1)
        return float((error * weight).sum()), float(weight.sum()) * error.shape[-1]

    def scored(self, batch: MaskedBatch) -> int:
        return int(batch.chosen.sum())  # chosen model frames


@dataclass
class LabelledBatch:
    features: Tensor  # (B, T, F) normalised log-mel
    lengths: Tensor  # (B,) 10 ms frames
    labels: Tensor  # (B,) utterance labels, or (B, T_lab) frame labels padded with -100
    label_lengths: Tensor | None  # (B,) for frame labels
    utt_ids: list[str]


class ProbeObjective(Objective[LabelledBatch]):
    """Cross-entropy / accuracy of a trained downstream `Probe` on `layers` of the head-masked
    upstream, run uncached; `target`: the task's label source (bound to the corpus), or its
    name for sources whose labels travel with the batches (speaker, phones)."""

    metric_name = "accuracy"
    higher_is_better = True

    def __init__(
        self,
        upstream: nn.Module,
        probe: nn.Module,
        layers: Sequence[int],
        batches: Iterable[dict[str, Any]],
        target: str | LabelSource,
        level: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.upstream = _frozen(upstream, self.device, dtype)
        self.probe = _frozen(probe, self.device, dtype)
        self.layers, self.level = list(layers), level
        labels = label_source(target)() if isinstance(target, str) else target
        prepared = [self._labelled(b, labels, level) for b in batches]
        self.frames = sum(int(b.lengths.sum()) for b in prepared)
        super().__init__(int(upstream.num_layers), int(upstream.num_heads), prepared)

    def _labelled(self, batch: dict[str, Any], source: LabelSource, level: str) -> LabelledBatch:
        features = batch["features"].to(self.device, self.dtype)
        lengths = batch["lengths"].to(self.device)
        labels, label_lengths = source.batch(batch, level)  # (B,) | (B, T) and (B,)
        return LabelledBatch(
            features,
            lengths,
            labels.to(self.device),
            None if label_lengths is None else label_lengths.to(self.device),
            list(batch["utt_ids"]),
        )

    def split(self, batch: LabelledBatch) -> list[LabelledBatch]:
        units = []
        frames = batch.label_lengths  # (B,) for frame labels, else None
        for b, n in enumerate(batch.lengths.tolist()):
            one = slice(b, b + 1)
            labels = batch.labels[one] if frames is None else batch.labels[one, : int(frames[b])]
            label_lengths = None if frames is None else frames[one]
            features, ids = batch.features[one, :n], batch.utt_ids[one]
            units.append(LabelledBatch(features, batch.lengths[one], labels, label_lengths, ids))
        return units

    def logits(self, unit: LabelledBatch, head_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Flat logits (M, C) and labels (M,): M utterances, or label frames for frame tasks."""
        out = self.upstream(unit.features, unit.lengths, head_mask)
        hidden, out_lengths = out.hidden_states, out.output_lengths  # L+1 x (B, T', D), (B,)
        T = int(out_lengths.max())
        stacked = torch.stack([hidden[i][:, :T] for i in self.layers], dim=1)  # (B, N, T', D)
        batch: dict[str, Any] = {
            "hidden": stacked,
            "lengths": out_lengths,
            "padding_mask": lengths_to_padding_mask(out_lengths, T),
            "utt_ids": unit.utt_ids,
        }
        if unit.label_lengths is not None:
            batch["label_lengths"] = unit.label_lengths
        return Probe.aligned(self.probe(batch), unit.labels)

    def loss(self, unit: LabelledBatch, head_mask: Tensor) -> Tensor | None:
        logits, labels = self.logits(unit, head_mask)
        if not bool((labels != IGNORE_INDEX).any()):
            return None
        return Probe.loss(logits, labels)

    def score(self, unit: LabelledBatch, head_mask: Tensor) -> tuple[float, float]:
        logits, labels = self.logits(unit, head_mask)
        valid = labels != IGNORE_INDEX
        correct = (logits.argmax(-1) == labels) & valid
        return float(correct.sum()), float(valid.sum())

    def scored(self, batch: LabelledBatch) -> int:
        return int((batch.labels != IGNORE_INDEX).sum())  # utterances or label frames


def _frozen(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Eval mode (no dropout), on device/dtype, parameters without gradients (only xi gets one)."""
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


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


def head_gradient(objective: Objective, unit: Any, head_mask: Tensor) -> Tensor | None:
    """Signed dL/dxi (L, h) of one unit at `head_mask`; None when the unit scores nothing."""
    xi = head_mask.detach().clone().requires_grad_(True)
    loss = objective.loss(unit, xi)
    return None if loss is None else torch.autograd.grad(loss, xi)[0]


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
        idx = torch.argsort(self.normalized.flatten().cpu(), stable=True).tolist()
        return [divmod(i, self.normalized.shape[1]) for i in idx]


def head_importance(
    objective: Objective,
    per: str = "utterance",
    head_mask: Tensor | None = None,
    progress: bool = False,
) -> Importance:
    """I = E_unit |dL/dxi| at `head_mask` (default all ones), normalised per depth; heads
    masked in `head_mask` get 0 in `normalized` (they are already pruned)."""
    head_mask = objective.ones() if head_mask is None else head_mask.to(objective.ones())
    acc_abs = torch.zeros_like(head_mask)
    acc = torch.zeros_like(head_mask)
    n = 0
    total = sum(1 for _ in objective.units(per)) if progress else None
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
    return sorted({*counts, cap})


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
    """Mask heads in increasing order of normalised importance, `step` of all heads at a time,
    from the unpruned model to every head masked (one left per depth with `keep_one_per_layer`);
    `recompute` re-estimates importance at the current mask before each step."""
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
    config = config or HeadsConfig()
    t = time.perf_counter()
    base = evaluate(objective)
    if not math.isfinite(base):  # every importance, ablation and pruning point would be NaN
        raise NonFiniteMetricError(
            f"the unmasked model's {objective.metric_name} is {base}: the upstream's hidden "
            f"states are NaN/inf (a diverged pretraining?), so no head can be scored"
        )
    importance = head_importance(objective, config.importance.per, progress=progress)
    times = {"importance": time.perf_counter() - t}
    t = time.perf_counter()
    a, p = config.ablation, config.pruning
    ablation = ablate(objective, a.single, a.keep_only, a.layer, base=base, progress=progress)
    times["ablation"] = time.perf_counter() - t
    t = time.perf_counter()
    points = []
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
