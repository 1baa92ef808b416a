"""The padding policy of the variants that place their pattern by frame position.

Such a variant (`Attention.end_padded_only`: blocks, strides, global frames, synthesised
columns) counts positions from frame 0, so frame 0 must be each utterance's first frame: a
padding mask (B, T) with padded frames before an utterance's first valid frame is refused
(`PaddingMaskError`); padded frames after it are masked keys at their positions.
`Attention.forward` applies the check; the other variants see only which keys are valid and
their distances, and give the same outputs for any padding.
"""

from __future__ import annotations

from torch import Tensor

from speechattn.errors import SpeechattnError


class PaddingMaskError(SpeechattnError, ValueError):
    """A padding mask a variant cannot use: padded frames before an utterance's first valid
    frame, given to a variant whose pattern is placed by frame position
    (`Attention.end_padded_only`)."""


def check_no_leading_padding(padding_mask: Tensor, name: str) -> None:
    """Refuse a padding mask (B, T) bool with padded frames before an utterance's first valid
    frame (padded frames after it, at the end or between valid ones, are masked keys at their
    positions); `name` is the variant's, for the message.

    A host read of the mask, made where it is free (CPU, eager): on a GPU and under
    torch.compile, where the kernels never read device data on the host, the mask is trusted
    (the model's masks come from lengths and are end-padded by construction,
    `lengths_to_padding_mask`)."""
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
