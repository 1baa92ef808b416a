"""Memory helpers of the kernels: zero tensors whose pages the OS zeroes on first touch."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # lazy_zeros' dtypes


def numpy_backed(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether tensors of this dtype and device can share memory with numpy (CPU float32/64)."""
    return torch.device(device).type == "cpu" and dtype in NUMPY_DTYPES


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor whose pages the OS zeroes on first touch (CPU float32/64: numpy's calloc'ed
    zeros, on transparent huge pages), so a caller writing a small part pays for those pages
    only; else torch.zeros."""
    if not numpy_backed(dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=NUMPY_DTYPES[dtype]))
