"""Memory helpers of the kernels: zero tensors whose pages the OS zeroes on first touch."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # lazy_zeros' dtypes


def numpy_backed(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether tensors of this dtype and device can share memory with numpy (CPU float32 or
    float64)."""
    return torch.device(device).type == "cpu" and dtype in NUMPY_DTYPES


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor whose pages are zeroed by the OS on first touch (CPU float32/float64).

    numpy's zeros are calloc'ed fresh memory, so no zero-fill pass runs and a caller that
    writes a small part pays for those pages only; numpy also marks large arrays for
    transparent huge pages (Linux, `madvise` mode). On the development VM 4 KiB page faults
    are slow, and 2 MiB pages cut the cost of first touches several times. Elsewhere (other dtypes, CUDA) plain torch.zeros.
    """
    if not numpy_backed(dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=NUMPY_DTYPES[dtype]))
