"""A GPU `.tolist()` is one host read: CUDA's tolist copies the tensor to the host inside it,
and the counter must not count that copy as a second read (an H200 run counted 2 for the
training step's single `check_step` read before)."""

from __future__ import annotations

import pytest
import torch
from _fake_cuda import CUDA, fake_cuda

from speechattn.bench.syncs import SyncCounter

pytestmark = pytest.mark.fakecuda


def test_tolist_of_device_data_is_one_read(monkeypatch):
    def cuda_like_tolist(t: torch.Tensor) -> list:
        t.to("cpu")  # what CUDA's tolist does before reading (fake data cannot be read)
        return []

    monkeypatch.setattr(torch.Tensor, "tolist", cuda_like_tolist)
    with fake_cuda():
        flags = torch.ones(3, dtype=torch.bool, device=CUDA)
        with SyncCounter(cpu_is_device=False) as counter:
            torch.Tensor.tolist(flags)  # FakeTensor overrides tolist: call the one patched
            flags.to("cpu")  # a copy outside a read is a read of its own
    assert dict(counter.reasons) == {"tolist": 1, "to_cpu": 1}
