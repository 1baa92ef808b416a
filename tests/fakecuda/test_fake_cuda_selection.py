"""The CUDA branches of LSH's sparse (CSR) kernel and routing's static sizes on fake CUDA.

`test_fake_cuda.py` trains with dropout, which sends LSH's long path to its gather kernel;
here LSH's CSR custom op runs too (eval mode and training without dropout), and LSH's
selection kernel alone with both tie-breaks and both level dtypes. Sparse tensors
cannot be faked, so the op's registered fake implementations stand in for its body: this
proves shapes, dtypes, devices and that nothing around the op reads device data; the CSR
products themselves (and their searchsorted transpose) run on a real GPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from speechattn.attention import build
from speechattn.attention.kernels import topk
from speechattn.bench.syncs import SyncCounter

sys.path.insert(0, str(Path(__file__).parents[1] / "attention"))
from _attention_testing import DIM, HEADS, SMALL_OPTIONS, force_path  # noqa: E402
from _fake_cuda import CUDA, backward, cuda_autocast, fake_cuda, to_fake_cuda  # noqa: E402

pytestmark = pytest.mark.fakecuda
T = 48


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ["xbox", "sign_alsh", "routing"])
def test_long_kernel_without_dropout_on_fake_cuda(name, padded, train, monkeypatch):
    force_path(monkeypatch, "long")
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, **SMALL_OPTIONS.get(name, {})).train(train)
    with fake_cuda() as mode:
        to_fake_cuda(attn, mode)
        x = torch.randn(2, T, DIM, device=CUDA, requires_grad=True)
        lengths = torch.tensor([T, T - 11], device=CUDA)
        pad = torch.arange(T, device=CUDA)[None, :] >= lengths[:, None] if padded else None
        with cuda_autocast(torch.bfloat16):
            y = attn(x, pad)
        assert y.device.type == "cuda" and y.shape == (2, T, DIM)
        leaves = backward([y], [torch.ones_like(y)])
    assert leaves[x].shape == x.shape and leaves[x].dtype == x.dtype
    assert leaves[attn.get_parameter("out_proj.weight")].device.type == "cuda"


@pytest.mark.parametrize("by_score", [True, False], ids=["score", "position"])
@pytest.mark.parametrize(
    ("bits", "hash"),
    [(8, "sign"), (62, "sign"), (8, "l2")],
    ids=["uint8-levels", "int16-levels", "l2-buckets"],
)
def test_lsh_selection_kernel_reads_nothing_on_fake_cuda(by_score, bits, hash, monkeypatch):
    """LSH's static-shape selection (the threshold's bisection, dense tie scores, ties by
    nearest key, positions by binary search), in several chunks, for sign bits and l2 buckets:
    no host read (fake data cannot be read) and no copy from the host."""
    monkeypatch.setattr(topk, "_MATCH_CHUNK", 4 * T * 10 * (bits if hash == "l2" else 1))
    with fake_cuda():
        if hash == "sign":
            cq, ck = (torch.rand(4, T, bits, device=CUDA) > 0.5 for _ in range(2))
        else:
            cq, ck = (torch.randint(0, 5, (4, T, bits), device=CUDA) for _ in range(2))
        kv = torch.rand(4, T, device=CUDA) > 0.2
        q, keys = (torch.randn(4, T, 16, device=CUDA) for _ in range(2))
        args = (q, keys) if by_score else ()
        with SyncCounter(cpu_is_device=False, trace=True) as syncs:
            idx = topk.topk_by_match(cq, ck, kv, 7, *args)
    assert idx.shape == (4, T, 7) and idx.device.type == "cuda" and idx.dtype == torch.long
    assert syncs.count == syncs.upload_count == 0, syncs.summary()
