"""Padding before an utterance's first frame: the variants whose pattern is placed by frame
position refuse it with an error naming the rule; every other variant gives the same outputs for the
valid frames as for the utterance alone. And synthesizers take a batch padded beyond max_len
whose utterances all fit."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import DIM, batch, make

from speechattn.attention import available, get
from speechattn.attention.base import PaddingMaskError
from speechattn.errors import SpeechattnError

POSITIONAL = [n for n in available() if get(n).end_padded_only]
ANY_PADDING = [n for n in available() if not get(n).end_padded_only]


def test_the_positional_variants_are_the_ones_that_need_it():
    assert sorted(POSITIONAL) == sorted(
        ["sparse_strided", "sparse_fixed", "longformer"]
        + ["syn_dense", "syn_dense_mh", "syn_random", "syn_fixed"]
    )


def _front_padded(front: int, n: int, back: int = 0, seed: int = 2):
    """x (1, n, D), and the same utterance with `front` padded frames before, `back` after."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, DIM, generator=g, dtype=torch.float64)
    noise = torch.randn(1, front + n + back, DIM, generator=g, dtype=torch.float64)
    xp = noise.clone()
    xp[:, front : front + n] = x
    pad = torch.ones(1, front + n + back, dtype=torch.bool)
    pad[:, front : front + n] = False
    return x, xp, pad


@pytest.mark.parametrize("name", POSITIONAL)
def test_padding_before_valid_frames_is_refused_by_positional_variants(name):
    _, xp, pad = _front_padded(5, 23, back=2)
    attn = make(name)
    with pytest.raises(PaddingMaskError, match=r"row 0 starts with 5 padded frames"):
        attn(xp, pad)
    with pytest.raises(SpeechattnError, match="padding must come after each utterance's first"):
        attn(xp, pad, need_weights=True)
    # padded frames after the first valid one are masked keys at their positions
    holes = torch.zeros_like(pad)
    holes[:, 3] = holes[:, -2:] = True
    torch.testing.assert_close(attn(xp, holes), attn.dense_reference(xp, holes)[0])


@pytest.mark.parametrize("name", ANY_PADDING)
@pytest.mark.parametrize(("front", "n", "back"), [(3, 40, 0), (30, 27, 4)])
def test_padding_anywhere_leaves_the_other_variants_outputs_alone(name, front, n, back):
    x, xp, pad = _front_padded(front, n, back)
    attn = make(name)
    torch.testing.assert_close(attn(xp, pad)[:, front : front + n], attn(x), rtol=0, atol=1e-10)
    assert (attn(xp, pad)[pad] == 0).all()


SYN = ["syn_dense", "syn_dense_mh", "syn_random", "syn_fixed"]


@pytest.mark.parametrize("name", SYN)
def test_synthesizers_take_a_batch_padded_beyond_max_len_when_utterances_fit(name):
    attn = make(name, max_len=32)
    x, pad = batch([32, 20], T=40)
    y = attn(x, pad)
    want = attn(x[:, :32], pad[:, :32])
    torch.testing.assert_close(y[:, :32], want, rtol=0, atol=0)
    assert y.shape == x.shape and (y[:, 32:] == 0).all()
    y_ref, w = attn(x, pad, need_weights=True)
    torch.testing.assert_close(y_ref, y)
    assert w.shape == (2, attn.num_heads, 40, 40) and (w[..., 32:] == 0).all()
    with pytest.raises(ValueError, match="T=33 exceeds max_len=32"):  # one does not fit
        attn(*batch([33, 20], T=40))
