"""Pretraining on CUDA turns TF32 on through torch's `fp32_precision` settings, not the legacy
`allow_tf32` flags (announced as deprecated; their getters raise once the new ones are set).
Key selection switches it off for itself (`attention/fp32.py`, tests/attention)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from speechattn.tasks.pretrain import PretrainTask

SETTINGS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)


@pytest.fixture
def restore_precision():
    previous = [s.fp32_precision for s in SETTINGS]
    yield
    for s, p in zip(SETTINGS, previous):
        s.fp32_precision = p


def _legacy(*_):
    raise AssertionError("legacy allow_tf32 setter used")


def test_setup_on_cuda_turns_tf32_on_with_the_fp32_precision_settings(
    restore_precision, monkeypatch
):
    monkeypatch.setattr(torch._C, "_set_cublas_allow_tf32", _legacy)
    monkeypatch.setattr(type(torch.backends.cudnn), "allow_tf32", property(fset=_legacy))
    on_cuda = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")))
    PretrainTask.setup(SimpleNamespace(trainer=on_cuda, _trainer=None), "fit")
    assert [s.fp32_precision for s in SETTINGS] == ["tf32"] * 3
