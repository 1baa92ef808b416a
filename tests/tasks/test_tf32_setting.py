"""Pretraining on CUDA turns TF32 on for float32 regions in a way that keeps
`torch.get_float32_matmul_precision()` answering: inductor calls it whenever it compiles (a
compiled step, Flex kernels), and it raises once torch's per-backend `fp32_precision`
attributes have been set directly. Key selection switches TF32 off for itself
(`attention/fp32.py`, tests/attention/test_selection_fp32.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from speechattn.attention import fp32
from speechattn.tasks.pretrain import PretrainTask


@pytest.fixture
def restore_precision():
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_setup_on_cuda_turns_tf32_on_and_compilers_can_still_read_it(restore_precision):
    on_cuda = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")))
    PretrainTask.setup(SimpleNamespace(trainer=on_cuda, _trainer=None), "fit")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"  # what inductor's cache key reads
    with fp32.true_float32():
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
