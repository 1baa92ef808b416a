"""Frame stacking used by the model (temporary local copy until `speechattn.data.features` lands)."""

from __future__ import annotations

import torch
import torch.nn.functional as F_
from torch import Tensor


def stacked_lengths(lengths: Tensor, factor: int) -> Tensor:
    """10 ms frame counts (B,) -> stacked frame counts ceil(T / factor) (B,)."""
    return torch.div(lengths + factor - 1, factor, rounding_mode="floor")


def stack_frames(x: Tensor, lengths: Tensor, factor: int = 3) -> tuple[Tensor, Tensor]:
    """x (B, T, F), lengths (B,) -> (B, ceil(T/factor), factor*F), ceil(lengths/factor).

    Frames past T are zero, so the last partial step of an utterance is zero-padded.
    """
    B, T, F = x.shape
    pad = (-T) % factor
    if pad:
        x = F_.pad(x, (0, 0, 0, pad))
    return x.reshape(B, (T + pad) // factor, factor * F), stacked_lengths(lengths, factor)
