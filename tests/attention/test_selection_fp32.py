"""Key selection in true float32 (`attention/fp32.py`): LSH hashing, match counting and
tie-break scores, routing's cluster assignments and centroid updates run with TF32 off even
when the global setting has it on (as pretraining sets it on CUDA), and ignore autocast; the
rest of a forward pass keeps the global setting.

No GPU here, so TF32 itself cannot run: a TorchDispatchMode records the setting cuBLAS reads,
`torch.backends.cuda.matmul.fp32_precision`, at every matrix product.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _attention_testing import batch, make
from torch.utils._python_dispatch import TorchDispatchMode

from speechattn.attention import fp32

aten = torch.ops.aten
# matmul decomposes into the others, except below autograd (inside a custom op), where the mode
# sees it whole
PRODUCTS = {aten.matmul, aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.mv}


class PrecisionAtProducts(TorchDispatchMode):
    """Records the CUDA float32 matmul precision setting at each matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in PRODUCTS:
            self.seen.append(torch.backends.cuda.matmul.fp32_precision)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def global_tf32():
    """TF32 on for float32 matmuls, as `PretrainTask.setup` sets it on CUDA."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(previous)


def _float32(name: str, **options) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A float32 module and its inputs: x (B, T, D) and valid (B, T)."""
    x, pad = batch([20, 13])
    return make(name, **options).float(), x.float(), ~pad


def _lsh_selection(attn, q, k, valid) -> None:
    attn.select(q, k, valid)
    attn.selection_dense(q, k, valid)


def _routing_selection(attn, q, k, valid) -> None:
    attn.members(k, valid)
    attn.selection_dense(q, k, valid)
    attn.update_centroids(k, valid)


def test_true_float32_turns_tf32_off_and_restores(global_tf32):
    with fp32.true_float32():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert torch.get_float32_matmul_precision() == "highest"  # inductor reads it
    with pytest.raises(RuntimeError, match="inside"), fp32.true_float32():
        raise RuntimeError("inside")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"  # the legacy getter still answers


@pytest.mark.parametrize(
    ("name", "options", "selection"),
    [
        ("xbox", {}, _lsh_selection),
        ("sign_alsh", {"tie_break": "position"}, _lsh_selection),
        ("routing", {}, _routing_selection),
    ],
    ids=["lsh-score", "lsh-position", "routing"],
)
def test_selection_products_run_with_tf32_off(global_tf32, name, options, selection):
    attn, x, valid = _float32(name, **options)
    q, k, _ = attn._qkv(x)
    with PrecisionAtProducts() as record:
        selection(attn.train(), q, k, valid)
    assert record.seen and set(record.seen) == {"ieee"}
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


@pytest.mark.parametrize(
    ("name", "selection"),
    [("xbox", lambda a, q, k, v: a.select(q, k, v)), ("routing", None)],
    ids=["lsh", "routing"],
)
def test_the_rest_of_a_pass_keeps_the_global_setting(global_tf32, name, selection, monkeypatch):
    """A training pass: projections and weighted sums see TF32, and only the selection's own
    products (counted alone, the same inputs) see it off. LSH takes its long path with dropout,
    whose weighted sums are plain products; routing selects and moves its centroids."""
    monkeypatch.setattr(type(make(name)), "short_path_max_t", 0)
    attn, x, valid = _float32(name, dropout=0.1)
    q, k, _ = attn._qkv(x)
    alone = copy.deepcopy(attn).train()
    with PrecisionAtProducts() as selecting:
        if selection is None:  # routing's long path: cluster members, then the centroid update
            alone.members(k, valid)
            alone.update_centroids(k, valid)
        else:
            selection(alone, q, k, valid)
    with PrecisionAtProducts() as passing:
        attn.train()(x, ~valid)
    assert passing.seen.count("ieee") == len(selecting.seen) > 0
    assert passing.seen.count("tf32") >= 2  # at least the input and output projections
    assert set(passing.seen) == {"ieee", "tf32"}


def test_compiled_selection_runs_with_tf32_off(global_tf32, monkeypatch):
    """Under torch.compile (one graph, no break) the products are the custom op's, which
    switch TF32 off at run time; the keys equal eager's."""
    seen: list[str] = []
    product = fp32._product

    def recorded(a, b):
        with PrecisionAtProducts() as record:
            out = product(a, b)
        seen.extend(record.seen)
        return out

    monkeypatch.setattr(fp32, "_product", recorded)
    attn, x, valid = _float32("xbox")
    q, k, _ = attn._qkv(x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(attn.select, backend="aot_eager", fullgraph=True)
        idx = compiled(q.detach(), k.detach(), valid)
    finally:
        torch._dynamo.reset()
    assert seen and set(seen) == {"ieee"}
    assert torch.equal(idx, attn.select(q, k, valid))


@pytest.mark.parametrize("name", ["xbox", "sign_alsh"])
def test_lsh_selection_ignores_bf16_autocast(name):
    """Codes, top-k keys and the dense reference's selection: the same under CPU bf16 autocast
    as in float32 without it, for float32 inputs and for bf16 ones (what autocast's
    projections give), which select as their float32 values."""
    attn, x, valid = _float32(name)
    q, k, _ = attn._qkv(x)
    q, k = q.detach(), k.detach()
    for qi, ki in ((q, k), (q.bfloat16(), k.bfloat16())):
        qf, kf = qi.float(), ki.float()
        want = (attn.codes(qf, qf, valid), attn.select(qf, kf, valid))
        want_dense = attn.selection_dense(qf, kf, valid)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = (attn.codes(qi, qi, valid), attn.select(qi, ki, valid))
            got_dense = attn.selection_dense(qi, ki, valid)
        for g, w in zip(got[0] + (got[1],), want[0] + (want[1],)):
            assert torch.equal(g, w)
        assert torch.equal(got_dense, want_dense)


def test_routing_selection_ignores_bf16_autocast():
    """Cluster assignments, member tables, the dense selection and the centroid update: the
    same under CPU bf16 autocast as in float32 without it."""
    attn, x, valid = _float32("routing")
    q, k, _ = attn._qkv(x)
    q, k = q.detach(), k.detach()
    ref = copy.deepcopy(attn)
    want = ref.members(k, valid)
    want_dense = ref.selection_dense(q, k, valid)
    ref.update_centroids(k, valid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn.members(k, valid)
        got_dense = attn.selection_dense(q, k, valid)
        attn.update_centroids(k, valid)
    for field in ("cluster", "order", "table"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(got_dense, want_dense)
    assert torch.equal(attn.centroids, ref.centroids)
