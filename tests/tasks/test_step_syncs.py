"""Host-device syncs per pretraining step: one read (the step's finite checks), no uploads.

One AALBERT step as `PretrainTask` runs it (the batch stacked and masked by the loader's
`BatchMasker`, `step_loss`, backward, `check_step`, the LAMB update, `after_update`), B=2,
T'=500 model frames, counted by `SyncCounter` with the CPU standing in for the device: every
CPU tensor is device data except the batch's host-side lengths and what is computed from them.
A few steps of a real `Trainer` are counted too, with Lightning's work around each step
(logging, the progress bar's metrics). The CUDA branches are counted on fake CUDA
(`tests/fakecuda`), where the copies themselves are seen.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from _pretrain_testing import SyntheticPretrainData, compose_pretrain

from speechattn.attention import available
from speechattn.bench.syncs import SyncCounter, pretrain_step_syncs

B, T = 2, 500  # utterances, model frames

# Variants whose attention reads data on the host in this CPU run, with the reason and the
# count measured here (the step's own read included). Kernels chosen for the CPU may decide
# from data (free there); their CUDA branches are checked sync-free on fake CUDA
# (tests/fakecuda).
CPU_KERNEL = "CPU kernel's host-side choice (free on a CPU; CUDA branch: tests/fakecuda)"
# one read per layer: the variants that place their pattern by position refuse a mask padded
# in front (`check_no_leading_padding`), on CPU in eager mode only
PADDING = "the padding-side check, CPU eager only"
ALLOWED: dict[str, tuple[str, int]] = {
    "sparse_strided": (f"{CPU_KERNEL}; {PADDING}", 5),
    "sparse_fixed": (f"{CPU_KERNEL}; {PADDING}", 5),
    "syn_dense": (PADDING, 3),
    "syn_dense_mh": (PADDING, 3),
    "syn_random": (f"{CPU_KERNEL}; {PADDING}", 11),
    "syn_fixed": (f"{CPU_KERNEL}; {PADDING}", 11),
    "longformer": (PADDING, 3),
    "adaptive_span": (CPU_KERNEL, 5),
    "routing": (CPU_KERNEL, 13),
    # LSH's CPU selection reads, per chunk of queries (one chunk per layer here), whether its
    # threshold's guess holds and the sizes of its candidate lists: 3 reads
    **{n: (CPU_KERNEL, 7) for n in ("sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh")},
}


def step_syncs(name: str) -> SyncCounter:
    """Syncs of the second training step of variant `name` (the first, not counted, creates
    LAMB's state and queues the parameters' check that the second reads with its own)."""
    net = {"feature_dim": 16, "dim": 32, "num_layers": 2, "num_heads": 2, "ffn_dim": 64}
    return pretrain_step_syncs({**net, "attention": name}, B, T, steps=2)


@pytest.mark.parametrize("name", available())
@pytest.mark.usefixtures("one_torch_thread")
def test_at_most_one_sync_per_step(name):
    last = step_syncs(name)
    reason, allowed = ALLOWED.get(name, ("", 1))
    assert last.count <= allowed, f"{name}: {last.summary()}" + (f" ({reason})" if reason else "")
    assert last.upload_count == 0, f"{name}: {last.summary()}"
    if name not in ALLOWED:
        assert last.reasons == {"tolist": 1}, last.summary()  # check_step's one read


def test_the_counter_sees_reads_of_device_data_and_not_of_host_data():
    lengths = torch.tensor([3, 2])
    x = torch.randn(2, 3)
    with SyncCounter(host=[lengths]) as syncs:
        int(lengths.max())  # host data and what derives from it: free
        lengths.tolist()
        int(torch.tensor(3))  # Python data: host data
        _ = x[x > 0]  # boolean indexing: a nonzero inside
        float(x.sum())
        x.nonzero()
        bool((x > 0).all())
        x.tolist()
        torch.repeat_interleave(lengths)  # host
        torch.repeat_interleave(torch.ones(2, dtype=torch.long))  # output size unknown
        torch.repeat_interleave(torch.ones(2, dtype=torch.long), output_size=2)
    assert syncs.reasons == {
        "index": 1, "_local_scalar_dense": 2, "nonzero": 1, "tolist": 1, "repeat_interleave": 1,
    }, syncs.summary()  # fmt: skip
    assert syncs.upload_count == 0, syncs.summary()


def test_the_stand_in_counts_uploads_of_host_data_apart_from_reads():
    """On a CPU, a copy's devices are all the CPU: what plainly makes device data of host
    data is an upload (`.to(device)` is counted on fake CUDA: tests/fakecuda)."""
    lengths, pinned = torch.tensor([3, 2]), torch.tensor([3.0, 2.0])
    x = torch.randn(2, 3)
    with SyncCounter(host=[lengths, pinned], pinned=[pinned], trace=True) as syncs:
        torch.tensor(0.5, device=x.device)  # Lightning's `self.log` of a float does this
        torch.as_tensor([1.0, 2.0], device=x.device)
        lengths.to(x)  # to a device tensor's device (and dtype); pageable
        pinned.to(x)  # pinned but blocking
        pinned.to(x, non_blocking=True)  # the loader's batch: overlaps, free
        x[0].copy_(lengths[:1].expand(3))  # host data into device data
        x.to(x)  # already device data: no copy
        lengths.to("cpu")  # host to host
        lengths.to(torch.float64)
        torch.tensor([0.5])  # stays on the host
    assert syncs.uploads == {"h2d_pageable": 4, "h2d_blocking": 1}, syncs.summary()
    assert syncs.count == 0, syncs.summary()
    where = next(iter(syncs.where))
    assert where.startswith("h2d_pageable at ") and "test_step_syncs.py:" in where, where
    assert syncs.summary() == "0 syncs, 5 uploads (h2d_pageable x4, h2d_blocking x1)"


def test_the_counter_passes_flex_attention_through():
    """Higher-order operators (eager FlexAttention on the CPU) run under the counter."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8)
    with SyncCounter() as syncs:
        out = flex_attention(q, q, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert syncs.count == syncs.upload_count == 0, syncs.summary()


class CountSteps(L.Callback):
    """Counts each training step whole: from its batch's start to the end of Lightning's own
    work on it (`on_batch_end` of its logger connector: the step's logged values turned into
    progress bar numbers), before the loader's next batch. The batch's lengths are host data,
    pinned as the loader pins them (on the host wherever they stay there). `only`: count
    that batch alone; `cpu_is_device` as `SyncCounter`'s (False on a GPU)."""

    def __init__(self, only: int | None = None, cpu_is_device: bool = True) -> None:
        self.only, self.cpu_is_device = only, cpu_is_device
        self.steps: list[SyncCounter] = []
        self._counting: SyncCounter | None = None

    def _stop(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def on_fit_start(self, trainer, pl_module) -> None:
        connector = trainer._logger_connector  # no hook runs after its on_batch_end
        on_batch_end = connector.on_batch_end

        def then_stop() -> None:
            on_batch_end()
            self._stop()

        connector.on_batch_end = then_stop

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.only is not None and batch_idx != self.only:
            return
        host = [t for t in (batch["lengths"], batch["masked"].lengths) if not t.is_cuda]
        counter = SyncCounter(host=host, pinned=host, cpu_is_device=self.cpu_is_device, trace=True)
        self._counting = counter.__enter__()
        self.steps.append(counter)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()


def test_a_trainer_step_reads_once_and_uploads_nothing(tmp_path: Path, monkeypatch):
    """Steps 1 and 2 of a `Trainer` (no logging step, no checkpoint, no validation): the one
    read of `check_step`, and no upload: `frames_per_s`, `lr`, `data_wait` and `train_loss`
    are logged as host values (a logged float would be copied to the device, and a logged
    device tensor shown in the progress bar read back, every step)."""
    import sys

    from speechattn.pretrain import run

    run_module = sys.modules["speechattn.tasks.pretrain.run"]  # the package's `run` is a function
    count, build_trainer = CountSteps(), run_module.build_trainer

    def with_count(*args, **kwargs) -> L.Trainer:
        trainer = build_trainer(*args, **kwargs)
        trainer.callbacks.append(count)
        return trainer

    monkeypatch.setattr(run_module, "build_trainer", with_count)
    cfg = compose_pretrain(
        tmp_path, "~data", "trainer.max_steps=4", "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=50", "checkpoint.every_n_steps=50", "validate_at_start=false",
    )  # fmt: skip
    run(cfg, SyntheticPretrainData())
    for step in count.steps[1:3]:  # the first creates LAMB's state and Lightning's metrics
        assert step.reasons == {"tolist": 1}, (step.summary(), dict(step.where))
        assert step.upload_count == 0, (step.summary(), dict(step.where))
