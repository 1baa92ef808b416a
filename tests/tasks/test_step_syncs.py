"""Host-device syncs per pretraining step (issue #23): at most one, the step's finite checks.

One AALBERT step as `PretrainTask` runs it (the batch stacked and masked by the loader's
`BatchMasker`, `step_loss`, backward, `check_step`, the LAMB update, `after_update`), B=2,
T'=500 model frames, counted by `SyncCounter` with the CPU standing in for the device: every
CPU tensor is device data except the batch's host-side lengths and what is computed from them.
"""

from __future__ import annotations

import pytest
import torch

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
    "syn_random": (f"{CPU_KERNEL}; {PADDING}", 13),
    "syn_fixed": (f"{CPU_KERNEL}; {PADDING}", 13),
    "longformer": (PADDING, 3),
    "adaptive_span": (CPU_KERNEL, 5),
    "routing": (CPU_KERNEL, 13),
}


def step_syncs(name: str) -> SyncCounter:
    """Syncs of the second training step of variant `name` (the first, not counted, creates
    LAMB's state and queues the parameters' check that the second reads with its own)."""
    net = {"feature_dim": 16, "dim": 32, "num_layers": 2, "num_heads": 2, "ffn_dim": 64}
    return pretrain_step_syncs({**net, "attention": name}, B, T, steps=2)


@pytest.mark.parametrize("name", available())
def test_at_most_one_sync_per_step(name):
    last = step_syncs(name)
    reason, allowed = ALLOWED.get(name, ("", 1))
    assert last.count <= allowed, f"{name}: {last.summary()}" + (f" ({reason})" if reason else "")
    if name not in ALLOWED:
        assert last.reasons == {"tolist": 1}, last.summary()  # check_step's one read


def test_the_counter_sees_reads_of_device_data_and_not_of_host_data():
    lengths = torch.tensor([3, 2])
    x = torch.randn(2, 3)
    with SyncCounter(host=[lengths]) as syncs:
        int(lengths.max())  # host data and what derives from it: free
        lengths.tolist()
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
