"""`prune_heads` (`speechattn.attention.pruning`) on every registered variant (a new variant
is tested on registration): the pruned module equals the unpruned one with xi = 0 on the
removed heads, on every kernel."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import HEADS, batch, force_path, kernels, make

from speechattn.attention import available, build
from speechattn.attention.pruning import prune_heads

LENGTHS = [17, 9, 1, 13]  # mixed lengths, one utterance of a single frame
KEEPS = ([0, 2], [1, 3], [3], [0, 1, 3])  # a mixed set, one without head 0, one head, a gap


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("name", "kernel"), kernels())
@pytest.mark.parametrize("keep", KEEPS, ids=lambda k: "keep" + "".join(map(str, k)))
def test_pruned_module_equals_head_masked_module(name, kernel, keep, monkeypatch):
    force_path(monkeypatch, kernel)
    full = make(name)
    pruned = make(name)
    prune_heads(pruned, keep)
    assert pruned.num_heads == len(keep) and pruned.kept_heads == keep
    assert _params(pruned) < _params(full)
    x, pad = batch(LENGTHS)
    xi = torch.zeros(HEADS, dtype=torch.float64)
    xi[keep] = 1.0
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    outs = []
    for module, head_mask in ((pruned, None), (full, xi)):
        xg = x.clone().requires_grad_(True)
        y = module(xg, pad, head_mask=head_mask)
        (y * w).sum().backward()  # gradients too: a pruned upstream can be fine-tuned
        outs.append((y.detach(), xg.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-9, atol=1e-11)
    # a head mask on the pruned module has one entry per kept head
    half = torch.full((len(keep),), 0.5, dtype=torch.float64)
    xi[keep] = 0.5
    torch.testing.assert_close(
        pruned(x, pad, head_mask=half), full(x, pad, head_mask=xi), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("name", available())
def test_pruned_weights_are_the_kept_heads_weights(name):
    full, pruned = make(name), make(name)
    keep = [1, 3]
    prune_heads(pruned, keep)
    x, pad = batch(LENGTHS)
    y_full, w_full = full(x, pad, need_weights=True)
    y, w = pruned(x, pad, need_weights=True)
    assert w.shape == (len(LENGTHS), 2, x.shape[1], x.shape[1])
    torch.testing.assert_close(w, w_full[:, keep], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", available())
def test_pruning_twice_composes_and_keeps_flops_consistent(name):
    once, twice = make(name), make(name)
    prune_heads(once, [1, 3])
    prune_heads(twice, [1, 2, 3])
    prune_heads(twice, [0, 2])  # heads 1 and 3 of the original
    assert twice.kept_heads == [1, 3]
    x, pad = batch(LENGTHS)
    torch.testing.assert_close(twice(x, pad), once(x, pad), rtol=1e-10, atol=1e-12)
    full = make(name)
    assert once.flops(32).inference < full.flops(32).inference
    assert "kept=[1, 3]" in repr(once)


@pytest.mark.parametrize("keep", [[], [0, 0], [4], [-1]])
def test_bad_keep_lists_are_refused(keep):
    attn = make("full")
    with pytest.raises(ValueError, match="distinct head indices"):
        prune_heads(attn, keep)


def test_pruned_sparse_and_longformer_heads_keep_their_pattern():
    """The roles by position survive: after pruning heads 0 and 1 of sparse_strided (band),
    both remaining heads are residue heads; longformer keeping only window heads has none
    dilated."""
    attn = make("sparse_strided")
    prune_heads(attn, [2, 3])
    assert attn.heads_first == 0
    attn = make("longformer")
    prune_heads(attn, [0, 1])
    assert attn.num_dilated == 0
    attn = make("routing")
    prune_heads(attn, [3])
    assert attn.heads_local == 0 and attn.centroids.shape[0] == 1


def test_pruned_syn_fixed_end_head_follows_its_pattern():
    """With 8 heads, head 6 ("end") reads each utterance's bottom-right corner; pruned to
    3 heads it is head 1 and still does."""
    torch.manual_seed(0)
    full = build("syn_fixed", 32, 8, max_len=64).double().eval()
    torch.manual_seed(0)
    pruned = build("syn_fixed", 32, 8, max_len=64).double().eval()
    prune_heads(pruned, [0, 6, 7])
    assert pruned.head_patterns == ["current", "end", None]
    x, pad = batch(LENGTHS)
    xi = torch.zeros(8, dtype=torch.float64)
    xi[[0, 6, 7]] = 1
    torch.testing.assert_close(pruned(x, pad), full(x, pad, head_mask=xi), rtol=1e-10, atol=1e-12)
