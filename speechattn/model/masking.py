"""Masked acoustic modelling (Mockingjay / AALBERT): corrupt spans of frames, reconstruct them.

For every utterance, about `fraction` of its valid model frames are chosen in consecutive spans
of `span` frames. Per utterance (not per frame, as in Mockingjay) one action is drawn: with
probability `p_zero` the chosen frames are zeroed (the mean of normalised features), with
`p_random` they are replaced by other frames of the same utterance drawn at random, otherwise
they are left unchanged (so the model cannot tell which frames it will be scored on). The loss
is L1 between the prediction and the clean frames, on chosen frames only.

The objective is written once, here: `corrupt(model, features, lengths, ...)` draws the masks
and `reconstruction_loss(model, masked, head_mask)` scores a reconstruction, for any model with
AALBERT's `stack` and `reconstruct` (pretraining, the head analysis and the benchmark's
hand-written reference all use them).

Short utterances never break a batch: the span shrinks to the utterance, and the number of spans
is drawn by stochastic rounding so that the expected fraction stays `fraction` even when it is
below one span. A batch in which nothing was chosen gives a loss of exactly 0 (with a graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

ZERO, RANDOM, UNCHANGED = 0, 1, 2  # per-utterance corruption modes


@dataclass
class MaskingConfig:
    fraction: float = 0.15  # of each utterance's valid model frames (BERT / Mockingjay)
    span: int = 7  # consecutive model frames per span: 7 x 30 ms = 210 ms, about two phones
    p_zero: float = 0.8  # BERT's 80 / 10 / 10 split, applied per utterance
    p_random: float = 0.1  # replace with random other frames of the same utterance

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"masking fraction must be in [0, 1], got {self.fraction}")
        if self.span < 1:
            raise ValueError(f"masking span must be >= 1, got {self.span}")
        if self.p_zero < 0 or self.p_random < 0 or self.p_zero + self.p_random > 1.0 + 1e-9:
            raise ValueError(
                f"need p_zero, p_random >= 0 and p_zero + p_random <= 1, "
                f"got {self.p_zero}, {self.p_random}"
            )


@dataclass
class MaskedBatch:
    """A batch corrupted for masked reconstruction, its masks drawn once."""

    inputs: Tensor  # (B, T', F') corrupted model input
    target: Tensor  # (B, T', F') clean stacked frames
    chosen: Tensor  # (B, T') bool, frames the loss is computed on (never padding)
    lengths: Tensor  # (B,) valid model frames
    mode: Tensor  # (B,) int64, ZERO / RANDOM / UNCHANGED per utterance

    def utterances(self) -> list[MaskedBatch]:
        """Each utterance as a batch of one, trimmed to its length."""
        return [
            MaskedBatch(
                self.inputs[b : b + 1, :n],
                self.target[b : b + 1, :n],
                self.chosen[b : b + 1, :n],
                self.lengths[b : b + 1],
                self.mode[b : b + 1],
            )
            for b, n in enumerate(self.lengths.tolist())
        ]


def choose_spans(length: int, cfg: MaskingConfig, generator: torch.Generator) -> Tensor:
    """Start indices of non-overlapping spans for an utterance of `length` valid frames.

    Spans are placed uniformly among non-overlapping placements: draw k distinct slots out of
    `length - k*(s-1)` and shift the i-th by i*(s-1). Adjacent spans may touch.
    """
    if length <= 0:
        return torch.empty(0, dtype=torch.long)
    s = min(cfg.span, length)
    expected = cfg.fraction * length / s  # spans, fractional
    k = int(expected)
    if torch.rand((), generator=generator).item() < expected - k:
        k += 1  # stochastic rounding keeps E[chosen frames] = fraction * length
    k = min(k, length // s)
    if k == 0:
        return torch.empty(0, dtype=torch.long)
    slots = torch.randperm(length - k * (s - 1), generator=generator)[:k].sort().values
    return slots + torch.arange(k) * (s - 1)


def mask_frames(
    x: Tensor, lengths: Tensor, cfg: MaskingConfig, generator: torch.Generator
) -> MaskedBatch:
    """Corrupt x (B, T', F') with valid lengths (B,) for masked reconstruction.

    All random draws use `generator` (a CPU generator), so the corruption is reproducible
    from its seed, independently of the device and of dropout's global RNG.
    """
    B, T, _ = x.shape
    lengths_cpu = lengths.detach().to("cpu", torch.long)
    chosen = torch.zeros(B, T, dtype=torch.bool)
    mode = torch.full((B,), UNCHANGED, dtype=torch.long)
    source = torch.arange(T).expand(B, T).clone()  # (B, T') index of the frame to copy in
    for b in range(B):
        n = int(lengths_cpu[b])
        starts = choose_spans(n, cfg, generator)
        u = torch.rand((), generator=generator).item()
        mode[b] = ZERO if u < cfg.p_zero else RANDOM if u < cfg.p_zero + cfg.p_random else UNCHANGED
        if len(starts) == 0:
            continue
        s = min(cfg.span, n)
        idx = (starts[:, None] + torch.arange(s)).reshape(-1)  # chosen positions, all < n
        chosen[b, idx] = True
        if mode[b] == RANDOM:
            source[b, idx] = torch.randint(0, n, (len(idx),), generator=generator)
    chosen = chosen.to(x.device)
    source = source.to(x.device)
    mode_dev = mode.to(x.device)
    inputs = torch.gather(x, 1, source[..., None].expand_as(x))  # RANDOM rows copied in
    zero = chosen & (mode_dev == ZERO)[:, None]
    inputs = inputs.masked_fill(zero[..., None], 0.0)
    return MaskedBatch(inputs=inputs, target=x, chosen=chosen, lengths=lengths, mode=mode)


def masked_l1(prediction: Tensor, target: Tensor, chosen: Tensor) -> Tensor:
    """Mean absolute error over the chosen frames' features: (B, T', F') x2, (B, T') -> ()."""
    weight = chosen[..., None].to(prediction.dtype)  # (B, T', 1)
    total = ((prediction - target).abs() * weight).sum()
    count = weight.sum() * prediction.shape[-1]
    return total / count.clamp(min=1.0)


class Reconstructor(Protocol):
    """What the objective needs of a model (AALBERT has it)."""

    def stack(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]: ...

    def reconstruct(
        self, inputs: Tensor, lengths: Tensor, head_mask: Tensor | None = None
    ) -> Tensor: ...


def corrupt(
    model: Reconstructor,
    features: Tensor,
    lengths: Tensor,
    cfg: MaskingConfig,
    generator: torch.Generator,
) -> MaskedBatch:
    """Stack features (B, T, F), lengths (B,) into model frames and corrupt them."""
    stacked, stacked_lengths = model.stack(features, lengths)  # (B, T', F'), (B,)
    return mask_frames(stacked, stacked_lengths, cfg, generator)


def reconstruction_loss(
    model: Reconstructor, masked: MaskedBatch, head_mask: Tensor | None = None
) -> Tensor:
    """Masked L1 of the model's reconstruction of `masked` (with head mask (L, h))."""
    prediction = model.reconstruct(masked.inputs, masked.lengths, head_mask)  # (B, T', F')
    return masked_l1(prediction, masked.target, masked.chosen)
