"""The CUDA branches without a GPU (`pytest -m fakecuda`, part of the default run).

Every variant's efficient path, on each side of its kernel crossover, runs forward and
backward on fake CUDA tensors under CUDA autocast to bf16 and fp16; one AALBERT pretraining
step (the loader's pinned batch copied over, loss, backward, optimiser step) runs the same
way. Any host-device sync inside (an `.item()`, `bool(t)`, `.tolist()`, `nonzero`, numpy)
raises here, as does any call into the real CUDA runtime; `SyncCounter` also counts every
copy of host memory to the device that blocks the host (pageable memory, or a blocking
copy): none is allowed. See `_fake_cuda.py` for what this proves and what only a GPU can.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from speechattn.attention import available, build
from speechattn.bench.syncs import SyncCounter
from speechattn.model.aalbert import preset_config
from speechattn.model.optim import build_optimizer
from speechattn.tasks.pretrain import PretrainTask

sys.path.insert(0, str(Path(__file__).parents[1] / "attention"))
from _attention_testing import DIM, HEADS, SMALL_OPTIONS, force_path, kernels  # noqa: E402
from _fake_cuda import (  # noqa: E402
    CUDA,
    backward,
    cuda_autocast,
    fake_cuda,
    parameter_grads,
    to_fake_cuda,
)

pytestmark = pytest.mark.fakecuda

# bf16, the study's GPU setting, in the fast tier; fp16 in the slow one
DTYPES = [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)]
T = 48


def _inputs(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(2, T, DIM, device=CUDA, requires_grad=True)
    if not padded:
        return x, None
    lengths = torch.tensor([T, T - 11], device=CUDA)
    return x, torch.arange(T, device=CUDA)[None, :] >= lengths[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name,path", kernels())
def test_variant_trains_on_fake_cuda(name, path, padded, dtype, monkeypatch):
    force_path(monkeypatch, path)
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, dropout=0.1, **SMALL_OPTIONS.get(name, {})).train()
    with fake_cuda() as mode:
        to_fake_cuda(attn, mode)
        x, pad = _inputs(padded)
        with SyncCounter(cpu_is_device=False, trace=True) as syncs:
            with cuda_autocast(dtype):
                y = attn(x, pad)
            assert y.device.type == "cuda" and y.shape == (2, T, DIM)
            assert y.dtype in (dtype, torch.float32), y.dtype
            leaves = backward([y], [torch.ones_like(y)])
        grads = parameter_grads(attn, leaves)
    assert syncs.count == syncs.upload_count == 0, (syncs.summary(), dict(syncs.where))
    trainable = {n for n, p in attn.named_parameters() if p.requires_grad}
    assert set(grads) <= trainable and grads, f"{name}: no parameter received a gradient"
    for n, g in grads.items():
        p = attn.get_parameter(n)
        assert g.device.type == "cuda" and g.dtype == p.dtype and g.shape == p.shape, n
    assert leaves[x].shape == x.shape and leaves[x].device.type == "cuda"


@pytest.mark.filterwarnings("ignore:You are trying to `self.log()`")  # no Trainer here
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", available())
def test_pretraining_step_on_fake_cuda(name, dtype):
    """AALBERT (tiny) + masked reconstruction + LAMB as `PretrainTask` trains: the loader's
    pinned batch copied to the device (lengths kept on the host), `step_loss`, backward, the
    optimiser step and `after_update` on fake CUDA, with no read of device data and no
    blocking upload. (`check_step`'s one read cannot run here: fake tensors hold no data.)"""
    torch.manual_seed(0)
    config = preset_config(
        "aalbert_tiny", attention=name, attention_options=SMALL_OPTIONS.get(name, {}), num_layers=2
    )
    task = PretrainTask(model=config.to_dict(), optimizer={"name": "lamb", "lr": 1e-3}).train()
    optimizer = build_optimizer(task, task.optim)
    stack, F = config.stack, config.feature_dim
    lengths = torch.tensor([T, T - 9]) * stack  # 10 ms frames, on the host
    features = torch.randn(2, T * stack, F)
    masked = task.batch_masker()(features, lengths, seed=0)  # the loader's host side
    pinned = [masked.inputs, masked.target, masked.chosen, masked.lengths, masked.mode]
    with fake_cuda() as mode:
        to_fake_cuda(task, mode)
        with SyncCounter(pinned=pinned, cpu_is_device=False, trace=True) as syncs:
            batch = {"masked": masked.to(CUDA), "lengths": lengths}  # as Lightning moves it
            with cuda_autocast(dtype):
                loss, _ = task.step_loss(batch)
            leaves = backward([loss], [torch.ones_like(loss)])
            for p in task.parameters():
                p.grad = leaves.get(p)
            optimizer.step()
            task.after_update()
        assert loss.device.type == "cuda" and loss.dtype == torch.float32
        assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in task.parameters())
    assert syncs.count == syncs.upload_count == 0, (syncs.summary(), dict(syncs.where))


def test_the_counter_sees_copies_between_host_and_device_on_fake_cuda():
    """What `SyncCounter` counts on a GPU, where the copies' devices tell host from device."""
    lengths, pinned = torch.tensor([3, 2]), torch.tensor([3, 2])
    with fake_cuda(), SyncCounter(pinned=[pinned], cpu_is_device=False, trace=True) as syncs:
        x = torch.zeros(2, device=CUDA)  # a fill on the device: no copy
        torch.tensor(0.5, device=CUDA)  # Lightning's `self.log` of a float does this
        lengths.to(CUDA, non_blocking=True)  # pageable: blocks whatever the flag says
        pinned.to(CUDA)  # pinned but blocking
        pinned.to(CUDA, non_blocking=True)  # the loader's batch: overlaps, free
        x.copy_(lengths)
        x + torch.tensor(2.0)  # a CPU scalar is a kernel argument: no copy
        x.cpu()  # a read
        lengths.tolist()  # host data: free
    assert syncs.uploads == {"h2d_pageable": 3, "h2d_blocking": 1}, syncs.summary()
    assert syncs.reasons == {"to_cpu": 1}, syncs.summary()
    assert any("test_fake_cuda.py:" in where for where in syncs.where), syncs.where


def test_bench_reference_model_reconstructs_on_fake_cuda():
    """`bench pretrain`'s hand-written BERT (its `reference` row) on the device, lengths on the
    host as the loader keeps them: the padding mask goes to the scores' device."""
    from speechattn.bench.pretrain import ReferenceAALBERT

    config = preset_config("aalbert_tiny", num_layers=2)
    model = ReferenceAALBERT(config)
    lengths = torch.tensor([T, T - 9])
    with fake_cuda() as mode:
        to_fake_cuda(model, mode)
        x = torch.randn(2, T, config.input_dim, device=CUDA)
        out = model.reconstruct(x, lengths)
        assert out.device.type == "cuda" and out.shape == (2, T, config.input_dim)
