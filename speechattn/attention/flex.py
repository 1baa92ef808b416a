"""FlexAttention for fixed-pattern heads: one call over every head, a cached BlockMask.

`torch.nn.attention.flex_attention` computes softmax(q k^T / sqrt(d_k) + score_mod) v and
skips the (128 x 128) query/key blocks that a `BlockMask` marks empty, so a band or block
pattern costs about its share of T x T. Here:

* lengths are padded up to a multiple of 128 (the "bucket");
* the BlockMask comes from an `envelope`: a mask_mod of positions and Python constants only
  that contains the pattern of every utterance the bucket can hold (e.g. a band as wide as
  the largest stride of the bucket), so it is built once per (pattern, heads, bucket, device)
  and cached, whatever the batch's strides and size (it broadcasts over the batch). It is
  built eagerly, before the compiled Flex call; inside a compiled region (the whole model
  under torch.compile) the cache is only read, and a missing mask is built in the graph and
  not stored (a cache written while tracing would hold traced values);
* the exact pattern and everything else that depends on the batch go into the `score_mod`,
  as tensors it captures (per-utterance strides (B,), allowed keys (B, T)): padded keys and
  keys outside the utterance's pattern get -inf, the query's own key the shared-QK self
  penalty (it is always allowed, so no row is empty). Captured tensors are inputs of the
  compiled kernel, not constants baked into it, so the kernel compiles once per (batch size,
  bucket) and never per stride (a stride as a Python int would be guarded on: one compile
  per stride, past dynamo's recompile limit of 8, then eager Flex over all T x T scores).

Flex kernels are compiled on CUDA (`CUDA_BACKEND`), with dynamo's recompile limit raised for
that call to `MAX_COMPILES` (one per bucket and batch size). Torch 2.11 has no Flex backward
on CPU, and its CPU forward is either compiled (tens of seconds per shape) or unfused (all
T x T scores): callers use their SDPA kernels there (`use_flex`); the tests run this forward
on CPU against the dense reference, eagerly, and compiled with the "eager" backend to count
compilations, and check on CPU that each BlockMask covers the blocks the patterns need.

On fake CUDA tensors (the fake-CUDA suite) Flex traces forward and backward with two
stand-ins the tests set (`tests/fakecuda/_fake_cuda.py: fake_flex`): Flex's autograd
differentiates the score_mod with the autograd engine on scalars of the query's device, and
the engine asks the CUDA driver for a context, which a machine without a GPU lacks
("hasPrimaryContext expects a valid device index"), so the score_mod's joint graph is traced
on CPU scalars (it is the same graph: a score_mod is elementwise); and inductor's code
generation needs a real device, so the compiled call uses the "eager" backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import SELF_PENALTY, compute_dtype

# (batch, head, query index, key index) -> bool: whether the head may use that key.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
BUCKET = 128  # Flex's default block size
# compiled Flex kernels allowed per process: a bucket each (16 buckets: T up to 2048) for a
# couple of batch sizes (the last batch of an epoch is often smaller)
MAX_COMPILES = 32
CUDA_BACKEND = "inductor"  # torch.compile backend of the Flex call on CUDA


def use_flex(q: Tensor, training: bool, dropout: float) -> bool:
    """Whether the Flex kernel can serve this call: CUDA (Flex's backward), no dropout (Flex
    has none), and a torch that ships FlexAttention."""
    return q.is_cuda and not (training and dropout) and _flex_module() is not None


try:
    from torch.nn.attention import flex_attention as _FLEX_MODULE
except ImportError:  # a torch without FlexAttention
    _FLEX_MODULE = None


def _flex_module():  # noqa: ANN202 - the torch module, or None
    # a plain function (no functools.cache): dynamo traces it inside compiled regions
    return _FLEX_MODULE


@functools.cache
def _compiled_flex(backend: str) -> Callable[..., Tensor]:
    return torch.compile(_flex_module().flex_attention, backend=backend, dynamic=False)


_BLOCK_MASKS: dict[Hashable, object] = {}
_MAX_BLOCK_MASKS = 64


def _block_mask(key: Hashable, mask_mod: MaskMod, heads: int, T: int, device: torch.device):  # noqa: ANN202
    """The BlockMask of `mask_mod` over (heads, T, T), for every batch, cached under
    (key, heads, T, device): `key` names the pattern, since mask_mod is a new closure per call.
    Written only outside compiled regions and for real tensors (see the module docstring)."""
    full_key = (key, heads, T, str(device))
    if full_key in _BLOCK_MASKS:
        return _BLOCK_MASKS[full_key]
    create = _flex_module().create_block_mask
    block_mask = create(mask_mod, None, heads, T, T, device=device)
    if torch.compiler.is_compiling() or _is_fake(block_mask.kv_num_blocks):
        return block_mask  # a traced or fake mask: not for later calls
    if len(_BLOCK_MASKS) >= _MAX_BLOCK_MASKS:
        _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))  # oldest first
    _BLOCK_MASKS[full_key] = block_mask
    return block_mask


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def block_mask_for(key: Hashable, envelope: MaskMod, heads: int, T: int, device: torch.device):  # noqa: ANN201 - a BlockMask
    """The cached BlockMask of `pattern_attention` for `envelope` (plus the self key) at T
    frames: its bucket's, over (heads, bucket(T), bucket(T)), broadcast over the batch."""

    def with_self(b: Tensor, hh: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return envelope(b, hh, i, j) | (i == j)

    return _block_mask(key, with_self, heads, bucket(T), device)


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
    dtype = compute_dtype(q)
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
        out = _flex_module().flex_attention(*args, score_mod=score_mod, block_mask=block_mask)
    else:
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILES):
            flex = _compiled_flex(backend)
            out = flex(*args, score_mod=score_mod, block_mask=block_mask)
    return out[:, :, :T]
