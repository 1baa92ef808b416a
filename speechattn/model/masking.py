"""Masked acoustic modelling (Mockingjay / AALBERT): corrupt spans of frames, reconstruct them
(the objective: docs/pretraining.md).

About `fraction` of each utterance's valid model frames are chosen in spans of `span` frames,
and one action is drawn per utterance (not per frame, as in Mockingjay): zero them (the
normalised mean), replace them by random frames of the same utterance, or leave them (so the
model cannot tell which frames are scored). The loss is L1 on chosen frames only; a batch in
which nothing was chosen gives exactly 0 (with a graph). `corrupt` and `reconstruction_loss`
serve any model with AALBERT's `stack` and `reconstruct`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from speechattn.data.features import stack_frames
from speechattn.errors import is_int, is_number, require

ZERO, RANDOM, UNCHANGED = 0, 1, 2  # per-utterance corruption modes


@dataclass
class MaskingConfig:
    fraction: float = 0.15  # of each utterance's valid model frames (BERT / Mockingjay)
    span: int = 7  # consecutive model frames per span: 7 x 30 ms = 210 ms, about two phones
    p_zero: float = 0.8  # BERT's 80 / 10 / 10 split, applied per utterance
    p_random: float = 0.1  # replace with random other frames of the same utterance

    def __post_init__(self) -> None:
        ok = is_number(self.fraction) and 0.0 <= self.fraction <= 1.0
        require(ok, "model.masking.fraction", self.fraction, "in [0, 1]")
        ok = is_int(self.span) and self.span >= 1
        require(ok, "model.masking.span", self.span, "an integer >= 1 (model frames)")
        for name in ("p_zero", "p_random"):
            value = getattr(self, name)
            require(is_number(value) and value >= 0, f"model.masking.{name}", value, ">= 0")
        ok = self.p_zero + self.p_random <= 1.0 + 1e-9
        rule = f"<= 1 - model.masking.p_zero={self.p_zero}"
        require(ok, "model.masking.p_random", self.p_random, rule)


@dataclass
class MaskedBatch:
    """A batch corrupted for masked reconstruction, its masks drawn on the host; `lengths` and
    `num_chosen` stay there, so that a step never reads device memory for them."""

    inputs: Tensor  # (B, T', F') corrupted model input
    target: Tensor  # (B, T', F') clean stacked frames
    chosen: Tensor  # (B, T') bool, frames the loss is computed on (never padding)
    lengths: Tensor  # (B,) valid model frames, on the host (CPU)
    mode: Tensor  # (B,) int64, ZERO / RANDOM / UNCHANGED per utterance
    num_chosen: int = 0  # chosen.sum(), counted on the host

    def to(self, device: torch.device | str, non_blocking: bool = True) -> MaskedBatch:
        """The tensors on `device`, lengths kept on the host (how Lightning moves the batch)."""
        moved = ("inputs", "target", "chosen", "mode")
        return replace(
            self, **{k: getattr(self, k).to(device, non_blocking=non_blocking) for k in moved}
        )

    def pin_memory(self) -> MaskedBatch:
        """Page-locked copies (lengths too), for the DataLoader's pinning thread."""
        pinned = ("inputs", "target", "chosen", "lengths", "mode")
        return replace(self, **{k: getattr(self, k).pin_memory() for k in pinned})

    def utterances(self) -> list[MaskedBatch]:
        """Each utterance as a batch of one, trimmed to its length."""
        return [
            MaskedBatch(
                self.inputs[b : b + 1, :n],
                self.target[b : b + 1, :n],
                self.chosen[b : b + 1, :n],
                self.lengths[b : b + 1],
                self.mode[b : b + 1],
                int(self.chosen[b, :n].sum()),
            )
            for b, n in enumerate(self.lengths.tolist())
        ]


def draw_spans(
    lengths: Tensor, T: int, cfg: MaskingConfig, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Span starts (B, T) bool and span lengths s (B,), on the host, for utterances of
    `lengths` (B,) valid frames, all at once.

    Per utterance of n frames: s = min(span, n); k spans, fraction * n / s rounded
    stochastically (E[chosen frames] = fraction * n even below one span), at most n // s,
    placed uniformly without overlap: k distinct slots of n - k(s-1) (the k smallest of i.i.d.
    keys), the i-th shifted by i(s-1). Adjacent spans may touch; none reaches past n.
    """
    n = lengths.to("cpu", torch.long)
    B = n.shape[0]
    s = n.clamp(max=cfg.span).clamp(min=1)  # (B,) (n = 0 has no spans: k = 0 below)
    expected = cfg.fraction * n.double() / s.double()  # (B,) spans, fractional
    k = expected.floor()
    k = k + (torch.rand(B, generator=generator, dtype=torch.float64) < expected - k).double()
    k = torch.minimum(k.long(), n // s)  # (B,)
    slots = n - k * (s - 1)  # (B,) placements of k non-overlapping spans = k distinct slots
    if T == 0:  # nothing to place (sort/gather below need a column)
        return torch.zeros(B, 0, dtype=torch.bool), s
    position = torch.arange(T)
    keys = torch.rand(B, T, generator=generator)
    keys = keys.masked_fill(position[None, :] >= slots[:, None], 2.0)  # past the slots: never
    kth = keys.sort(dim=1).values.gather(1, (k - 1).clamp(min=0)[:, None])  # (B, 1)
    picked = (keys <= kth) & (k > 0)[:, None]  # (B, T) the k picked slots (ties: p ~ 0)
    index = picked.cumsum(dim=1) - 1  # (B, T) i of a picked slot among its row's picks
    start = position[None, :] + index * (s[:, None] - 1)  # slot j -> j + i(s-1) <= n - s
    starts = torch.zeros(B, T + 1, dtype=torch.bool)  # column T: where unpicked slots go
    starts.scatter_(1, torch.where(picked, start, T), True)
    return starts[:, :T], s


def draw_masks(
    lengths: Tensor, T: int, cfg: MaskingConfig, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Masks for utterances of `lengths` (B,) valid frames (on the host) padded to T, all drawn
    at once from `generator` in a fixed order: spans as `draw_spans`, one mode per utterance,
    and for RANDOM rows a frame of the utterance drawn uniformly for each chosen frame ->
    chosen (B, T) bool, source (B, T) int64 (the frame copied into each position), mode (B,)."""
    n = lengths.to("cpu", torch.long)
    B = n.shape[0]
    starts, s = draw_spans(n, T, cfg, generator)  # (B, T), (B,)
    # chosen[t]: a span starts in (t-s, t]: a difference of cumulative counts, s per row
    count = torch.nn.functional.pad(starts.long().cumsum(dim=1), (1, 0))  # (B, T+1)
    t = torch.arange(1, T + 1)
    chosen = (count[:, t] - count.gather(1, (t[None, :] - s[:, None]).clamp(min=0))) > 0
    u = torch.rand(B, generator=generator, dtype=torch.float64)
    mode = torch.full((B,), UNCHANGED, dtype=torch.long)
    mode = torch.where(u < cfg.p_zero + cfg.p_random, RANDOM, mode)
    mode = torch.where(u < cfg.p_zero, ZERO, mode)
    other = (torch.rand(B, T, generator=generator) * n[:, None]).long()  # uniform in [0, n)
    other = torch.minimum(other, (n - 1).clamp(min=0)[:, None])  # u * n rounded up to n
    source = torch.arange(T).expand(B, T)
    source = torch.where(chosen & (mode == RANDOM)[:, None], other, source)
    return chosen, source, mode


def mask_frames(
    x: Tensor, lengths: Tensor, cfg: MaskingConfig, generator: torch.Generator
) -> MaskedBatch:
    """Corrupt x (B, T', F') with valid lengths (B,) (best on the host: else a sync) for masked
    reconstruction, the masks drawn from `generator`, a CPU generator (`draw_masks`): the
    corruption depends on its seed alone, not on the device or dropout's RNG."""
    lengths_cpu = lengths.detach().to("cpu", torch.long)
    chosen, source, mode = draw_masks(lengths_cpu, x.shape[1], cfg, generator)

    def on_device(*index: Tensor) -> tuple[Tensor, ...]:
        return tuple(i.to(x.device, non_blocking=True) for i in index)

    # the chosen frames by (row, frame) index, found on the host (free there): writing only
    # them into a copy of x is ~3x faster on a CPU than a masked_fill over all of x
    inputs = x.clone()
    rows, cols = (chosen & (mode == ZERO)[:, None]).nonzero(as_tuple=True)
    if len(rows):  # ZERO rows' chosen frames
        inputs[on_device(rows, cols)] = 0.0
    rows, cols = (chosen & (mode == RANDOM)[:, None]).nonzero(as_tuple=True)
    if len(rows):  # RANDOM rows' chosen frames copied in (a few % of the frames)
        inputs[on_device(rows, cols)] = x[on_device(rows, source[rows, cols])]
    chosen_dev = chosen.to(x.device, non_blocking=True)
    return MaskedBatch(inputs, x, chosen_dev, lengths_cpu, mode, int(chosen.sum()))


def mask_batch(
    features: Tensor,
    lengths: Tensor,
    stack: int,
    cfg: MaskingConfig,
    generator: torch.Generator,
    pad_to_multiple: int = 1,
    max_model_frames: int | None = None,
) -> MaskedBatch:
    """Host side of a pretraining step, for the data loader: stack 10 ms features (B, T, F)
    with lengths (B,) into model frames padded to a multiple of `pad_to_multiple` (at most
    `max_model_frames`), and corrupt them. The multiple gives a compiled step few shapes and
    SDPA masks it need not pad to its alignment."""
    T = -(-features.shape[1] // stack)  # model frames
    padded = -(-T // pad_to_multiple) * pad_to_multiple
    if max_model_frames is not None:
        padded = max(T, min(padded, max_model_frames))
    stacked, stacked_lengths = stack_frames(features, lengths, stack, frames=padded)
    return mask_frames(stacked, stacked_lengths, cfg, generator)


def masked_l1(prediction: Tensor, target: Tensor, chosen: Tensor) -> Tensor:
    """Mean absolute error over the chosen frames' features: (B, T', F') x2, (B, T') -> ()."""
    weight = chosen[..., None].to(prediction.dtype)  # (B, T', 1)
    total = ((prediction - target).abs() * weight).sum()
    count = weight.sum() * prediction.shape[-1]
    return total / count.clamp(min=1.0)


def corrupt(
    model: nn.Module,
    features: Tensor,
    lengths: Tensor,
    cfg: MaskingConfig,
    generator: torch.Generator,
) -> MaskedBatch:
    """Stack features (B, T, F), lengths (B,) into model frames and corrupt them."""
    stacked, stacked_lengths = model.stack(features, lengths)  # (B, T', F'), (B,)
    return mask_frames(stacked, stacked_lengths, cfg, generator)


def reconstruction_loss(
    model: nn.Module, masked: MaskedBatch, head_mask: Tensor | None = None
) -> Tensor:
    """Masked L1 of the model's reconstruction of `masked` (with head mask (L, h))."""
    prediction = model.reconstruct(masked.inputs, masked.lengths, head_mask)  # (B, T', F')
    return masked_l1(prediction, masked.target, masked.chosen)
