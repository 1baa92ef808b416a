"""FlexAttention for fixed-pattern heads: one call over every head, a cached BlockMask
(design: docs/attention.md, "CUDA kernels of the pattern variants"; fake CUDA: docs/gpu.md).

Lengths are padded to a multiple of 128 (the bucket). The BlockMask comes from an `envelope` of
positions only, so it is built once per (pattern, heads, bucket, device). The exact pattern,
padding and self penalty go into the `score_mod` as captured tensors: inputs of the compiled
kernel, so it compiles once per (batch size, bucket), never per stride (an int stride would be
guarded on, past dynamo's recompile limit). Compiled on CUDA only: torch 2.11 has no Flex
backward on CPU (`use_flex`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention import flex_attention as flex_module

from speechattn.attention.base import SELF_PENALTY, compute_dtype

# (batch, head, query index, key index) -> bool: whether the head may use that key.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
BUCKET = 128  # Flex's default block size
MAX_COMPILES = 32  # compiled kernels per process: 16 buckets (T <= 2048) x 2 batch sizes
CUDA_BACKEND = "inductor"  # torch.compile backend of the Flex call on CUDA


def use_flex(q: Tensor, training: bool, dropout: float) -> bool:
    """Whether the Flex kernel can serve this call: CUDA, no dropout (Flex has none)."""
    return q.is_cuda and not (training and dropout)


@functools.cache
def _compiled_flex(backend: str) -> Callable[..., Tensor]:
    return torch.compile(flex_module.flex_attention, backend=backend, dynamic=False)


_BLOCK_MASKS: dict[Hashable, object] = {}
_MAX_BLOCK_MASKS = 64


def block_mask_for(key: Hashable, envelope: MaskMod, heads: int, T: int, device: torch.device):  # noqa: ANN201 - a BlockMask
    """The BlockMask for `envelope` plus the self key over (heads, bucket(T), bucket(T)), cached
    under (key, heads, bucket, device) outside compiled regions, for real tensors."""

    def with_self(b: Tensor, hh: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return envelope(b, hh, i, j) | (i == j)

    Tb = bucket(T)
    full_key = (key, heads, Tb, str(device))
    if full_key in _BLOCK_MASKS:
        return _BLOCK_MASKS[full_key]
    block_mask = flex_module.create_block_mask(with_self, None, heads, Tb, Tb, device=device)
    if torch.compiler.is_compiling() or is_fake(block_mask.kv_num_blocks):
        return block_mask  # a traced or fake mask: not for later calls
    if len(_BLOCK_MASKS) >= _MAX_BLOCK_MASKS:
        _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))  # oldest first
    _BLOCK_MASKS[full_key] = block_mask
    return block_mask


def bucket(T: int) -> int:
    return -(-T // BUCKET) * BUCKET


def pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv: Tensor,
    pattern: MaskMod,
    envelope: MaskMod,
    key: Hashable,
    backend: str | None = None,
) -> Tensor:
    """Shared-QK pattern attention: q, k, v (B, h, T, d_k), kv (B, T) allowed keys ->
    (B, h, T, d_k) in SDPA's dtype. pattern: each head's keys per utterance (the own key added,
    penalised); envelope: positions only, allowing every key `pattern` may allow in the bucket,
    named by `key`; backend: None is "inductor" on CUDA, eager elsewhere."""
    B, h, T, d = q.shape
    Tb = bucket(T)
    dtype = compute_dtype(q)  # Flex is not an autocast op
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    def pad(t: Tensor) -> Tensor:  # contiguous: a length of whole buckets (no padding)
        return F.pad(t, (0, 0, 0, Tb - T)).contiguous()  # must not bring other strides

    allowed = F.pad(kv, (0, Tb - T))  # (B, Tb); bucket padding is never a key

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, i: Tensor, j: Tensor) -> Tensor:
        own = i == j
        score = torch.where(own, score + SELF_PENALTY, score)
        return torch.where((pattern(b, hh, i, j) & allowed[b, j]) | own, score, float("-inf"))

    block_mask = block_mask_for(key, envelope, h, T, q.device)
    backend = backend or (CUDA_BACKEND if q.is_cuda else None)
    args = pad(q), pad(k), pad(v)
    if backend is None or torch.compiler.is_compiling():
        out = flex_module.flex_attention(*args, score_mod=score_mod, block_mask=block_mask)
    else:
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILES):
            flex = _compiled_flex(backend)
            out = flex(*args, score_mod=score_mod, block_mask=block_mask)
    return out[:, :, :T]
