"""Custom autograd Functions under CUDA autocast (fake CUDA tensors, `pytest -m fakecuda`):
each declares what it computes in, whatever precision its inputs arrive in."""

from __future__ import annotations

import pytest
import torch
from _fake_cuda import CUDA, backward, cuda_autocast, fake_cuda

from speechattn.attention.kernels.linear import LinearKernel

pytestmark = pytest.mark.fakecuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_linear_kernel_runs_in_float32_under_cuda_autocast(dtype, padded):
    """Half-precision q, k, v handed straight to the kernel (no caller widening): custom_fwd
    casts them to float32 (S and z are sums of T terms), the gradients return in the inputs'
    dtype."""
    with fake_cuda():
        q, k, v = (
            torch.randn(2, 4, 48, 8, device=CUDA, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        keep = torch.ones(2, 1, 48, 1, device=CUDA) if padded else None
        with cuda_autocast(dtype):
            out = LinearKernel.apply(q, k, v, keep, None)
        assert out.dtype == torch.float32 and out.shape == q.shape
        with cuda_autocast(dtype):  # the engine would run backward under the same state
            grads = backward([out], [torch.ones_like(out)])
    for t in (q, k, v):
        assert grads[t].dtype == dtype and grads[t].shape == t.shape
        assert grads[t].device.type == "cuda"
