"""Attention variants studied by speechattn, chosen by name.

    from speechattn.attention import available, build
    attn = build("ldsa", dim=768, num_heads=12, context=15)
    y = attn(x, padding_mask=pad)                    # (B, T, D)
    y, w = attn(x, padding_mask=pad, need_weights=True)  # w (B, h, T, T)

Each family lives in its own file and registers itself on import (explicit imports below).
"""

from speechattn.attention import dot_product, ldsa, lsh, sparse, synthesizer  # noqa: F401
from speechattn.attention.base import Attention, AttentionConfig
from speechattn.attention.pooling import FusedAttentionPool
from speechattn.attention.registry import available, build, get, register

__all__ = [
    "Attention",
    "AttentionConfig",
    "FusedAttentionPool",
    "available",
    "build",
    "get",
    "register",
]
