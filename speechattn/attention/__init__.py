"""Attention variants studied by speechattn, chosen by name.

    from speechattn.attention import available, build
    attn = build("ldsa", dim=768, num_heads=12, context=15)
    y = attn(x, padding_mask=pad)                    # (B, T, D)
    y, w = attn(x, padding_mask=pad, need_weights=True)  # w (B, h, T, T)

The variants and their contract: docs/attention.md.
"""

# Each family registers itself on import; this order is `available()`'s (the study's tables).
# isort: off
from speechattn.attention import dot_product  # noqa: F401  full, shared_qk
from speechattn.attention import sparse  # noqa: F401  sparse_strided, sparse_fixed
from speechattn.attention import lsh  # noqa: F401  sign_alsh, xbox, xbox_qnf, simple_lsh, simple_alsh
from speechattn.attention import synthesizer  # noqa: F401  syn_dense, syn_dense_mh, syn_random, syn_fixed
from speechattn.attention import ldsa  # noqa: F401  ldsa
from speechattn.attention import longformer  # noqa: F401  longformer
from speechattn.attention import linear  # noqa: F401  linear
from speechattn.attention import relpos  # noqa: F401  relpos
from speechattn.attention import adaptive_span  # noqa: F401  adaptive_span
from speechattn.attention import routing  # noqa: F401  routing

# isort: on
from speechattn.attention.base import Attention, AttentionConfig, Flops
from speechattn.attention.pooling import FusedAttentionPool
from speechattn.attention.registry import available, build, get, register

__all__ = [
    "Attention",
    "AttentionConfig",
    "Flops",
    "FusedAttentionPool",
    "available",
    "build",
    "get",
    "register",
]
