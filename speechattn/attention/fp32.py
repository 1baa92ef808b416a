"""True float32 for the code that selects keys, whatever the global TF32 setting.

LSH bits, tie-break scores and nearest centroids are hard decisions defined in float32
(docs/attention.md); TF32 would change them. `true_float32()` uses only
`torch.set_float32_matmul_precision` (setting torch 2.11's `fp32_precision` directly breaks the
getter inductor calls); dynamo cannot trace the switch, hence the custom op under compile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


@contextlib.contextmanager
def true_float32() -> Iterator[None]:
    """Float32 matmuls in IEEE float32 (no TF32, no bf16 passes) inside the block."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with true float32 and autocast off (inputs keep their dtypes)."""
    with true_float32():
        if not torch.is_autocast_enabled(a.device.type):  # the usual case: skip the guard's cost
            return a @ b
        with torch.autocast(a.device.type, enabled=False):
            return a @ b


@torch.library.custom_op("speechattn::ieee_matmul", mutates_args=())
def _ieee_matmul_op(a: Tensor, b: Tensor) -> Tensor:
    return _product(a, b)


@_ieee_matmul_op.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    with torch.autocast(a.device.type, enabled=False):  # the real op's dtype, not autocast's
        return a @ b


def ieee_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for selection, no gradient: float32 in IEEE float32 whatever the TF32 setting,
    autocast off; other dtypes as they are (LSH's +-1 codes may stay half precision, exact)."""
    a, b = a.detach(), b.detach()
    if torch.compiler.is_compiling():
        return _ieee_matmul_op(a, b)
    return _product(a, b)
