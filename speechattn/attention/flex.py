"""FlexAttention for fixed-pattern heads: one call over every head, a cached BlockMask.

`torch.nn.attention.flex_attention` computes softmax(q k^T / sqrt(d_k) + score_mod) v and
skips the (128 x 128) query/key blocks that a `BlockMask` marks empty, so a band or block
pattern costs about its share of T x T. Here:

* lengths are padded up to a multiple of 128 (the "bucket");
* the BlockMask comes from an `envelope`: a mask_mod of positions and Python constants only
  that contains the pattern of every utterance the bucket can hold (e.g. a band as wide as
  the largest stride of the bucket), so it is built once per (pattern, heads, bucket) and
  cached, whatever the batch's strides;
* the exact pattern and everything else that depends on the batch go into the `score_mod`,
  as tensors it captures (per-utterance strides (B,), allowed keys (B, T)): padded keys and
  keys outside the utterance's pattern get -inf, the query's own key the shared-QK self
  penalty (it is always allowed, so no row is empty). Captured tensors are inputs of the
  compiled kernel, not constants baked into it, so the kernel compiles once per (batch size,
  bucket) and never per stride (a stride as a Python int would be guarded on: one compile
  per stride, past dynamo's recompile limit of 8, then eager Flex over all T x T scores).

Flex kernels are compiled on CUDA, with dynamo's recompile limit raised for that call to
`MAX_COMPILES` (one per bucket and batch size). Torch 2.11 has no Flex backward on CPU, and
its CPU forward is either compiled (tens of seconds per shape) or unfused (all T x T
scores): callers use their SDPA kernels there (`use_flex`); the tests run this forward on
CPU against the dense reference, eagerly, and compiled with the "eager" backend to count
compilations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import SELF_PENALTY

# (batch, head, query index, key index) -> bool: whether the head may use that key.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
BUCKET = 128  # Flex's default block size
# compiled Flex kernels allowed per process: a bucket each (16 buckets: T up to 2048) for a
# couple of batch sizes (the last batch of an epoch is often smaller)
MAX_COMPILES = 32


def use_flex(q: Tensor, training: bool, dropout: float) -> bool:
    """Whether the Flex kernel can serve this call: CUDA (Flex's backward), no dropout (Flex
    has none), and a torch that ships FlexAttention."""
    return q.is_cuda and not (training and dropout) and _flex_module() is not None


@functools.cache
def _flex_module():  # noqa: ANN202 - the torch module, or None
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


@functools.cache
def _compiled_flex(backend: str) -> Callable[..., Tensor]:
    return torch.compile(_flex_module().flex_attention, backend=backend, dynamic=False)


_BLOCK_MASKS: dict[Hashable, object] = {}
_MAX_BLOCK_MASKS = 64


def _block_mask(key: Hashable, mask_mod: MaskMod, heads: int, T: int, device: str):  # noqa: ANN202
    """The BlockMask of `mask_mod` over (heads, T, T), for every batch, cached under
    (key, heads, T, device): `key` names the pattern, since mask_mod is a new closure per call."""
    full_key = (key, heads, T, device)
    if full_key not in _BLOCK_MASKS:
        if len(_BLOCK_MASKS) >= _MAX_BLOCK_MASKS:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))  # oldest first
        create = _flex_module().create_block_mask
        _BLOCK_MASKS[full_key] = create(mask_mod, None, heads, T, T, device=device)
    return _BLOCK_MASKS[full_key]


def bucket(T: int) -> int:
    """T rounded up to a multiple of `BUCKET`."""
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
    """Shared-QK pattern attention by FlexAttention.

    q, k, v (B, h, T, d_k); kv (B, T) keys that may be attended; pattern the keys each head
    of each utterance may use (the query's own key is added): a mask_mod that may read
    per-utterance tensors it captures; envelope a mask_mod of positions and constants only
    that allows every key `pattern` allows for any utterance of at most `bucket(T)` frames;
    key names the envelope for the BlockMask cache (e.g. (variant, largest stride)).
    backend: torch.compile backend of the Flex call; None: "inductor" on CUDA, eager Flex
    elsewhere (inside a torch.compile region the caller's compilation takes it).
    Scores q k^T / sqrt(d_k), the self key penalised by -5e4 as in `shared_qk`. Returns
    (B, h, T, d_k) in the dtype SDPA would use (the autocast dtype under autocast, else q's).
    """
    B, h, T, d = q.shape
    Tb = bucket(T)
    # Flex is not an autocast op: give it the dtype SDPA would run in.
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    def pad(t: Tensor) -> Tensor:  # contiguous: a length of whole buckets (no padding)
        return F.pad(t, (0, 0, 0, Tb - T)).contiguous()  # must not bring other strides

    allowed = F.pad(kv, (0, Tb - T))  # (B, Tb); bucket padding is never a key

    def with_self(b: Tensor, hh: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return envelope(b, hh, i, j) | (i == j)

    def score_mod(score: Tensor, b: Tensor, hh: Tensor, i: Tensor, j: Tensor) -> Tensor:
        own = i == j
        score = torch.where(own, score + SELF_PENALTY, score)
        return torch.where((pattern(b, hh, i, j) & allowed[b, j]) | own, score, float("-inf"))

    block_mask = _block_mask(key, with_self, h, Tb, str(q.device))
    backend = backend or ("inductor" if q.is_cuda else None)
    args = pad(q), pad(k), pad(v)
    if backend is None or torch.compiler.is_compiling():
        out = _flex_module().flex_attention(*args, score_mod=score_mod, block_mask=block_mask)
    else:
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILES):
            flex = _compiled_flex(backend)
            out = flex(*args, score_mod=score_mod, block_mask=block_mask)
    return out[:, :, :T]
