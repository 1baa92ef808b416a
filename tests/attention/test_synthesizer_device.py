"""The random synthesizers' CUDA / torch.compile path (windows by device ops, no host reads),
run on the CPU: exact against the CPU kernels and the dense reference, no graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _attention_testing import DIM, batch

from speechattn.attention import build, synthesizer

LENGTHS = [20, 13, 20, 0]  # padded utterances, one without any valid frame


def _pass(attn, x, pad, w, dense: bool = False):
    """(y, dL/dx, dL/dlogits) of L = sum(y * w)."""
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    y = attn.dense_reference(xi, pad)[0] if dense else attn(xi, pad)
    (y * w).sum().backward()
    return y.detach(), xi.grad, attn.logits.grad.clone()


@pytest.mark.parametrize("name", ["syn_random", "syn_fixed"])
@pytest.mark.parametrize("max_len", [20, 24])  # windows reach the table's edge, or stay inside
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_device_windows_match_cpu_kernels_and_reference(name, max_len, padded, monkeypatch):
    torch.manual_seed(0)
    attn = build(name, DIM, 8, max_len=max_len).double()  # syn_fixed: 7 patterns + 1 random
    with torch.no_grad():
        attn.logits.add_(torch.randn_like(attn.logits))  # leave the initial patterns
    x, pad = batch(LENGTHS if padded else [20, 20])
    pad = pad if padded else None
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    want = [_pass(attn, x, pad, w, dense=True)]
    for limit in (10**9, 0):  # CPU: explicit weights, table kernel
        monkeypatch.setattr(type(attn), "short_path_max_t", limit)
        want.append(_pass(attn, x, pad, w))
    monkeypatch.setattr(synthesizer, "needs_static_shapes", lambda t: True)  # as on CUDA
    got = [_pass(attn, x, pad, w), _pass(attn, x, pad, w, dense=True)]
    for a in got:
        for b in want:
            for ta, tb in zip(a, b):
                torch.testing.assert_close(ta, tb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["syn_random", "syn_fixed"])
def test_random_synthesizers_compile_without_graph_breaks(name):
    torch.manual_seed(0)
    attn = build(name, DIM, 8, max_len=24, dropout=0.1).train()
    for lengths in ([20, 20], [20, 13]):
        x, pad = batch(lengths)
        x = x.float().requires_grad_(True)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda x, pad: attn(x, pad))(
            x, pad if 13 in lengths else None
        )
        assert explained.graph_break_count == 0, explained.break_reasons
