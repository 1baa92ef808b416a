"""Downstream probes on frozen upstream features, and `Probe` (layer selection + head + label
alignment + loss), behind both the downstream task and the head analysis' probe objective.
Shape letters: B batch, N cached hidden layers, T frames, D feature dim, C classes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

from speechattn.data.features import expand_to_labels
from speechattn.errors import ConfigError
from speechattn.utils import IGNORE_INDEX


class LayerSelector(nn.Module):
    """Collapse the cached layer axis: identity for one layer, else a softmax-weighted sum
    (s3prl's `Featurizer`), uniform at first, that can mix layers but never scale them."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        if num_layers < 1:
            raise ConfigError(f"LayerSelector needs at least one layer, got {num_layers}")
        self.num_layers = num_layers
        self.logits = nn.Parameter(torch.zeros(num_layers)) if num_layers > 1 else None

    def weights(self) -> Tensor:
        """Mixing weights (N,), summing to one."""
        return torch.ones(1) if self.logits is None else self.logits.softmax(dim=0)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (B, N, T, D) -> (B, T, D)."""
        if hidden.dim() != 4 or hidden.size(1) != self.num_layers:
            raise ValueError(
                f"expected hidden states (B, {self.num_layers}, T, D), got {tuple(hidden.shape)}"
            )
        if self.logits is None:
            return hidden[:, 0]
        return torch.einsum("bntd,n->btd", hidden, self.weights().to(hidden.dtype))


class MeanPool(nn.Module):
    """Average over valid frames: (B, T, D), padding_mask (B, T) True=pad -> (B, D)."""

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        count = keep.sum(dim=1).clamp_min(1.0)  # (B, 1): an empty utterance pools to zeros
        return (x * keep).sum(dim=1) / count


class FusedPool(nn.Module):
    """FusedAttention pooling (docs/attention.md) behind MeanPool's signature; `scale` "value"
    and "key" give the same scores here (u = d = D), passed on as the config states it."""

    def __init__(self, dim: int, scale: str = "value") -> None:
        super().__init__()
        from speechattn.attention import FusedAttentionPool

        self.pool = FusedAttentionPool(dim, scale=scale)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """x (B, T, D), padding_mask (B, T) -> (B, D)."""
        return self.pool(x, padding_mask)


POOLINGS = ("mean", "fused")


class UtteranceProbe(nn.Module):
    """Pool the frames of each utterance, then a linear classifier: (B, T, D) -> (B, C)."""

    def __init__(
        self, dim: int, num_classes: int, pooling: str = "mean", pooling_scale: str = "value"
    ) -> None:
        super().__init__()
        if pooling == "mean":
            self.pool: nn.Module = MeanPool()
        elif pooling == "fused":
            self.pool = FusedPool(dim, pooling_scale)
        else:
            raise ConfigError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        return self.classifier(self.pool(x, padding_mask))


class FrameProbe(nn.Module):
    """Per-frame classifier, (B, T, D) -> (B, T, C): linear, or `hidden_layers` of Linear ->
    ReLU (-> dropout) with `hidden_dim` units first (the study's phoneme heads)."""

    def __init__(
        self,
        dim: int,
        num_classes: int,
        hidden_layers: int = 0,
        hidden_dim: int = 768,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = dim
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.net(x)


class Probe(nn.Module):
    """Layer selection + the task's head: batch -> logits (B, C) for utterance-level tasks, or
    (B, T, C) at the 10 ms label rate for frame-level ones (each upstream frame's logits
    repeated `downsample` times and trimmed/padded to the labels, within `tolerance`)."""

    def __init__(
        self,
        level: str,
        input_dim: int,
        num_layers: int,
        num_classes: int,
        downsample: int,
        tolerance: int,
        pooling: str = "mean",
        pooling_scale: str = "value",
        hidden_layers: int = 0,
        hidden_dim: int = 768,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.level, self.downsample, self.tolerance = level, downsample, tolerance
        self.select = LayerSelector(num_layers)
        if level == "utterance":
            self.head: nn.Module = UtteranceProbe(input_dim, num_classes, pooling, pooling_scale)
        else:
            self.head = FrameProbe(input_dim, num_classes, hidden_layers, hidden_dim, dropout)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        """batch: hidden (B, N, T', D), padding_mask (B, T'), lengths (B,); frame tasks also
        label_lengths (B,) and utt_ids."""
        x = self.select(batch["hidden"])  # (B, T', D)
        if self.level == "utterance":
            return self.head(x, batch["padding_mask"])
        valid = ~batch["padding_mask"]  # (B, T')
        frames = self.head(x[valid])  # (V, C): valid frames only, padding would cost a third
        logits = frames.new_zeros(*valid.shape, frames.size(-1))  # (B, T', C)
        logits[valid] = frames
        return expand_to_labels(
            logits,
            self.downsample,
            batch["label_lengths"],
            batch["utt_ids"],
            self.tolerance,
            lengths=batch["lengths"],
        )  # (B, T, C)

    @staticmethod
    def aligned(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Flat logits (M, C) and labels (M,): M utterances, or label frames of frame tasks
        (label-rate logits and labels cut to their common length)."""
        if logits.dim() == 3:  # expand_to_labels pads to the longest label; keep both aligned
            T = min(logits.size(1), labels.size(1))
            logits, labels = logits[:, :T], labels[:, :T]
        return logits.reshape(-1, logits.size(-1)), labels.reshape(-1)

    @staticmethod
    def loss(flat_logits: Tensor, flat_labels: Tensor) -> Tensor:
        """Cross-entropy over the labelled items (`IGNORE_INDEX` excluded)."""
        return Fn.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
