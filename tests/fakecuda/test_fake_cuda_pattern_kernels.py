"""The pattern heads' CUDA kernels on fake CUDA: sparse_*'s blocked, masked and Flex kernels
and routing's masked local heads, forward and backward under bf16 autocast, padded and not.

`test_fake_cuda.py` runs each variant's rule (masked for sparse_* at these lengths on CUDA);
here every kernel runs, forced by the `kernel` option (routing: by the tuner's switch), and
any host read inside one raises. Flex traces with the stand-ins of `_fake_cuda.fake_flex`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from speechattn.attention import autotune, build, flex

sys.path.insert(0, str(Path(__file__).parents[1] / "attention"))
from _attention_testing import DIM, HEADS, SMALL_OPTIONS  # noqa: E402
from _fake_cuda import (  # noqa: E402
    CUDA,
    backward,
    cuda_autocast,
    fake_cuda,
    fake_flex,
    parameter_grads,
    to_fake_cuda,
)

pytestmark = [
    pytest.mark.fakecuda,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]
T = 150  # two Flex buckets of 128


def _train_step(attn: torch.nn.Module, padded: bool) -> None:
    """Forward and backward of attn on fake CUDA under bf16 autocast; checks devices, dtypes
    and that every parameter gets a gradient."""
    with fake_cuda() as mode:
        to_fake_cuda(attn, mode)
        x = torch.randn(2, T, DIM, device=CUDA, requires_grad=True)
        lengths = torch.tensor([T, T - 53], device=CUDA)
        pad = torch.arange(T, device=CUDA)[None, :] >= lengths[:, None] if padded else None
        with cuda_autocast(torch.bfloat16):
            y = attn(x, pad)
        assert y.device.type == "cuda" and y.shape == (2, T, DIM) and y.dtype == torch.bfloat16
        leaves = backward([y], [torch.ones_like(y)])
        grads = parameter_grads(attn, leaves)
    assert leaves[x].shape == x.shape and leaves[x].device.type == "cuda"
    assert set(grads) == {n for n, p in attn.named_parameters() if p.requires_grad}
    for n, g in grads.items():
        assert g.dtype == attn.get_parameter(n).dtype, n


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("kernel", ["blocked", "masked", "flex"])
@pytest.mark.parametrize(
    ("name", "options"),
    [("sparse_strided", {}), ("sparse_fixed", {}), ("sparse_fixed", {"block": 7, "summary": 2})],
)
def test_sparse_kernel_trains_on_fake_cuda(name, options, kernel, padded, monkeypatch):
    fake_flex(monkeypatch)
    ran = []
    pattern_attention = flex.pattern_attention
    monkeypatch.setattr(flex, "pattern_attention", lambda *a, **kw: ran.append(1) or pattern_attention(*a, **kw))  # fmt: skip
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, kernel=kernel, **options).eval()  # Flex: no dropout
    try:
        _train_step(attn, padded)
    finally:
        torch._dynamo.reset()
    assert bool(ran) == (kernel == "flex")


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_routing_masked_local_heads_train_on_fake_cuda(padded):
    torch.manual_seed(0)
    attn = build("routing", DIM, HEADS, dropout=0.1, **SMALL_OPTIONS["routing"]).train()
    with autotune.forced(attn, "masked"):
        _train_step(attn, padded)


def test_cuda_rule_is_the_masked_kernel_up_to_its_crossover():
    from speechattn.attention import sparse

    attn = build("sparse_strided", DIM, HEADS)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attn.rule_kernel(T, cuda) == "masked" and attn.rule_kernel(T, cpu) == "blocked"
    assert attn.rule_kernel(sparse.MASKED_MAX_T_CUDA + 1, cuda) == "blocked"
    with fake_cuda():
        q = torch.empty(2, HEADS, T, DIM // HEADS, device=CUDA)
        assert attn.kernel_candidates(q) == ("blocked", "masked")  # flex only when named
        assert autotune.pick_kernel(attn, q) == "masked"  # fake tensors: the rule, never a timing


def test_full_padded_batch_passes_its_key_mask_to_sdpa_on_fake_cuda(monkeypatch):
    """`full` on a padded batch on CUDA: one SDPA call with the (B, 1, 1, T) bool key mask,
    which cuDNN's fused flash kernel takes on Hopper GPUs (measured: docs/gpu.md)."""
    import torch.nn.functional as F

    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    torch.manual_seed(0)
    _train_step(build("full", DIM, HEADS).eval(), padded=True)
    assert len(masks) == 1 and masks[0].shape == (2, 1, 1, T) and masks[0].dtype == torch.bool
