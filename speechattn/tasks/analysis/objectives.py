"""The objectives of the head analysis: L and the metric over a fixed data subset, as functions
of the head mask xi (L, h). `PretrainObjective`: masked-reconstruction L1 under masks drawn once
per batch from a fixed seed (lower is better); `ProbeObjective`: a trained downstream probe's
cross-entropy and accuracy on the upstream run uncached with the head mask.

Shape letters: B batch, T 10 ms frames, T' model frames, F' stacked features (3F), D model dim,
L depths, h heads per depth, N hidden layers the probe reads, C classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from speechattn.errors import ConfigError
from speechattn.model.aalbert import AALBERT
from speechattn.model.masking import MaskedBatch, MaskingConfig, corrupt, reconstruction_loss
from speechattn.model.probes import Probe
from speechattn.tasks.downstream.labels import LabelSource, label_source
from speechattn.utils import IGNORE_INDEX, derive_seed, lengths_to_padding_mask

PER_CHOICES = ("utterance", "batch")  # the units importance averages |dL/dxi| over
U = TypeVar("U")


class Objective(ABC, Generic[U]):
    """A loss L(unit, xi) to differentiate and a metric to ablate, over a fixed data subset.

    `batches` are prepared once (features on the device, fixed masks); a unit is a batch or
    one utterance cut out of one (`split`), trimmed to its own length.
    """

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

    def num_units(self, per: str) -> int:
        return sum(1 for _ in self.units(per))

    def ones(self) -> Tensor:
        """xi = 1 everywhere: (L, h) in the model's dtype and device."""
        return torch.ones(self.num_layers, self.num_heads, dtype=self.dtype, device=self.device)


class PretrainObjective(Objective[MaskedBatch]):
    """Masked-reconstruction L1 of an AALBERT (encoder + reconstruction head)."""

    metric_name = "l1_loss"
    higher_is_better = False

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
    """A labelled batch in the downstream task's label layout."""

    features: Tensor  # (B, T, F) normalised log-mel
    lengths: Tensor  # (B,) 10 ms frames
    labels: Tensor  # (B,) utterance labels, or (B, T_lab) frame labels padded with -100
    label_lengths: Tensor | None  # (B,) for frame labels
    utt_ids: list[str]


class ProbeObjective(Objective[LabelledBatch]):
    """Cross-entropy / accuracy of a trained downstream probe on the head-masked upstream.

    `probe` is a `speechattn.model.probes.Probe` (the downstream run's `DownstreamProbe` is
    one): a batch dict with hidden (B, N, T', D), padding_mask, label_lengths, utt_ids ->
    logits (B, C) or (B, T_lab, C); `layers` are the hidden-state indices it was trained on.
    """

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
        """`target`: the task's label source (bound to the corpus), or its name for sources
        whose labels travel with the batches (speaker, phones)."""
        self.device, self.dtype = torch.device(device), dtype
        self.upstream = _frozen(upstream, self.device, dtype)
        self.probe = _frozen(probe, self.device, dtype)
        self.layers = list(layers)
        self.level = level
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
            units.append(
                LabelledBatch(
                    batch.features[one, :n],
                    batch.lengths[one],
                    labels,
                    label_lengths,
                    batch.utt_ids[one],
                )
            )
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
    module = module.to(device=device, dtype=dtype).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module
