"""The padding policy of the variants that place their pattern by frame position
(`Attention.end_padded_only`), which `Attention.forward` applies."""

from __future__ import annotations

from torch import Tensor

from speechattn.errors import SpeechattnError


class PaddingMaskError(SpeechattnError, ValueError):
    """A padding mask a variant cannot use: padded frames before an utterance's first valid
    frame, given to a variant whose pattern is placed by frame position
    (`Attention.end_padded_only`)."""


def check_no_leading_padding(padding_mask: Tensor, name: str) -> None:
    """Refuse a padding mask (B, T) bool with padded frames before an utterance's first valid
    frame (later padded frames are masked keys at their positions); `name`: the variant's.
    A host read, made only where it is free (CPU, eager): elsewhere the mask is trusted (the
    model's masks come from lengths, end-padded by construction)."""
    leading = padding_mask[:, 0] & ~padding_mask.all(-1)  # (B,): padded first, valid later
    if bool(leading.any()):
        b = int(leading.nonzero()[0])
        first = int((~padding_mask[b]).nonzero()[0])
        raise PaddingMaskError(
            f"{name}: padding_mask row {b} starts with {first} padded frames before its first "
            f"valid frame; {name} places its pattern by frame position, counted from frame 0, "
            "so padding must come after each utterance's first frame (pad at the end, e.g. "
            "speechattn.utils.lengths_to_padding_mask), or use a variant that takes any padding"
        )
