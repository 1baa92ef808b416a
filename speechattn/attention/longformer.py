"""Sliding-window, dilated-window and global attention: `longformer`.

Beltagy, Peters, Cohan, "Longformer: The Long-Document Transformer", 2020 (arXiv:2004.05150),
section 3.1, bidirectional. Scores as in `full`; query i of head h attends key j (both valid) when

    window heads (the first h - `dilated_heads`):  |i - j| <= w
    dilated heads (the last `dilated_heads`):      |i - j| <= w delta  and  (i - j) mod delta = 0
    every head:                                    i or j is a global frame

Global frames are 0, g, 2g, ... (g = `global_every`; 0 = none): speech has no [CLS] token, so
a regular grid stands in for the paper's chosen tokens, whose scores reuse the Q, K, V
projections. Details and kernels: docs/attention.md, "longformer".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from speechattn.attention import patterns
from speechattn.attention.autotune import use_short_path
from speechattn.attention.base import AttentionConfig, all_valid, key_mask, require, scale
from speechattn.attention.dot_product import FullAttention
from speechattn.attention.kernels.blocks import _attend, _blocks, block_windows, window_offsets
from speechattn.attention.registry import register


@dataclass
class LongformerConfig(AttentionConfig):
    window: int = 16  # w (480 ms each side)
    dilation: int = 4  # delta (1.9 s)
    dilated_heads: int | None = None  # the last heads use the dilated window; None: floor(h / 2)
    global_every: int = 64  # g (1.9 s); 0: no global frames

    def __post_init__(self) -> None:
        super().__post_init__()
        w, delta, hd, g = self.window, self.dilation, self.dilated_heads, self.global_every
        require(w >= 1, f"longformer window w must be >= 1, got {w}")
        require(delta >= 1, f"longformer dilation must be >= 1 (1: no gaps), got {delta}")
        require(
            hd is None or 0 <= hd <= self.num_heads,
            f"longformer dilated_heads must be in [0, num_heads={self.num_heads}] or None, "
            f"got {hd}",
        )
        require(g >= 0, f"longformer global_every must be >= 0 (0: no global frames), got {g}")

    @property
    def num_dilated(self) -> int:
        return self.num_heads // 2 if self.dilated_heads is None else self.dilated_heads


def _fold_classes(t: Tensor, step: int, dim: int) -> Tensor:
    """Residue classes mod `step` along `dim` into the batch (zero/False padded):
    (B, ..., T, ...) -> (B step, ..., m, ...), m = ceil(T / step); frame a step + r is entry a of
    batch index b step + r."""
    t = _blocks(t, step, dim)  # (B, ..., m, step, ...)
    return t.movedim(dim + 1, 1).flatten(0, 1)


def _unfold_classes(t: Tensor, step: int, T: int) -> Tensor:
    """Inverse of `_fold_classes` for (B step, H, m, d) -> (B, H, T, d)."""
    t = t.unflatten(0, (-1, step)).movedim(1, 3)  # (B, H, m, step, d)
    return t.flatten(2, 3)[:, :, :T]


def band_global_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv: Tensor,
    glob: Tensor,
    kg: Tensor,
    vg: Tensor,
    kvg: Tensor,
    w: int,
    p: float = 0.0,
) -> Tensor:
    """Band |a - b| <= w plus G global keys, one softmax per query: q, k, v (B, H, m, d), kv
    (B, m) allowed keys, glob (B, m) global frames (out of the band), kg, vg (B, H, G, d), kvg
    (B, G) -> (B, H, m, d). A padded query may use its own key, so that no row is empty."""
    B, H, m, d = q.shape
    n, G = (m + w - 1) // w, kg.shape[2]
    rel = window_offsets(w, q.device)  # (l, 3l), l = w
    band_keys = block_windows(kv & ~glob, w, 1)[:, :, None, :]  # (B, n, 1, 3l)
    pad_self = (rel == 0) & ~_blocks(kv, w, 1)[..., None]  # (B, n, l, 3l)
    allowed = torch.cat(
        [(rel.abs() <= w) & band_keys | pad_self, kvg[:, None, None, :].expand(B, n, w, G)],
        dim=-1,
    )  # (B, n, l, 3l + G)

    def with_globals(t: Tensor, tg: Tensor) -> Tensor:  # -> (B, H, n, 3l + G, d)
        return torch.cat([block_windows(t, w, 2), tg[:, :, None].expand(B, H, n, G, d)], dim=3)

    kb, vb = with_globals(k, kg), with_globals(v, vg)
    out = _attend(_blocks(q, w), kb, vb, allowed[:, None], q.new_zeros(()), p)
    return out.reshape(B, H, n * w, d)[:, :, :m]  # (B, H, m, d)


@register("longformer")
class LongformerAttention(FullAttention):
    """Window and dilated-window heads plus global frames (see module docstring)."""

    end_padded_only = True
    Config = LongformerConfig
    paper = "Beltagy et al., Longformer: The Long-Document Transformer, 2020"
    complexity_training = "O(T (w + T/g) D)"
    complexity_inference = "O(T (w + T/g) D)"
    short_path_max_t = 256  # all-pairs SDPA with the pattern as a mask up to here

    def __init__(self, config: LongformerConfig) -> None:
        super().__init__(config)
        self.window, self.dilation = config.window, config.dilation
        self.global_every = config.global_every
        self.num_dilated = config.num_dilated

    def _mean_keys(self, T: int, step: int) -> float:
        """Keys of one head's pattern per query, averaged over T frames (O(T w), no T x T)."""
        j, inside = patterns.window_keys(T, self.window, step)  # (T, 2w + 1)
        count, g = inside.sum(-1), self.global_every
        if g:  # plus the global frames outside the window; a global row has every frame
            count = count + -(-T // g) - (inside & (j % g == 0)).sum(-1)
            count = torch.where(torch.arange(T) % g == 0, T, count)
        return float(count.double().mean())

    def keys_attended(self, T: int) -> float:
        keys = [(h.stop - h.start) * self._mean_keys(T, step) for h, step in self.head_steps()]
        return sum(keys) / self.num_heads  # window heads, then dilated heads

    def _remove_heads(self, index: Tensor) -> None:
        # window heads stay a prefix and dilated heads a suffix (index is sorted)
        first_dilated = self.num_heads - self.num_dilated
        self.num_dilated = int((index >= first_dilated).sum())

    def head_steps(self) -> list[tuple[slice, int]]:
        """(heads, step) of the two head groups: window heads step 1, dilated heads delta."""
        hw = self.num_heads - self.num_dilated
        groups = [(slice(0, hw), 1), (slice(hw, self.num_heads), self.dilation)]
        return [(heads, step) for heads, step in groups if heads.stop > heads.start]

    def pattern(self, valid: Tensor) -> Tensor:
        """(B, h, T, T) bool: each head's pattern on allowed keys, plus a padded query's own key."""
        T, g = valid.shape[1], self.global_every
        i, j = patterns.grid(T, valid.device)
        heads = []
        for group, step in self.head_steps():
            local = patterns.in_band(i, j, self.window * step) & patterns.same_residue(i, j, step)
            heads += [local] * (group.stop - group.start)
        pat = torch.stack(heads)  # (h, T, T)
        if g:
            pat = pat | (i % g == 0) | (j % g == 0)  # global frames' rows and columns
        kv = key_mask(valid)
        return pat & kv[:, None, None, :] | (i == j) & ~kv[:, None, :, None]

    def pattern_bias(
        self, valid: Tensor | None, T: int, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """`pattern` as an additive mask, (1 or B, h, T, T); each head group's window a strided
        view of 2T - 1 offsets (the boolean pattern is slower than `full` itself)."""
        offset = torch.arange(1 - T, T, device=device)  # i - j
        groups = []
        for heads, step in self.head_steps():
            outside = (offset.abs() > self.window * step) | (offset % step != 0)
            row = torch.zeros(2 * T - 1, dtype=dtype, device=device).masked_fill(outside, -math.inf)
            window = patterns.toeplitz(row, T, T)  # (T, T)
            groups.append(window.expand(heads.stop - heads.start, T, T))
        bias = torch.cat(groups)[None]  # (1, h, T, T)
        if self.global_every:
            bias[..., :: self.global_every, :] = 0.0
            bias[..., :: self.global_every] = 0.0
        if valid is None:
            return bias
        # padded keys out, a padded query keeps its own key (never decided by reading the mask)
        kv = key_mask(valid)
        own = torch.eye(T, dtype=torch.bool, device=device) & ~kv[:, None, :, None]
        return bias.masked_fill(~kv[:, None, None, :], -math.inf).masked_fill(own, 0.0)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        if use_short_path(self, x):
            mask = self.pattern_bias(valid, x.shape[1], q.dtype, q.device)  # (1 or B, h, T, T)
            return self.sdpa(q, k, v, mask)
        kv = all_valid(x) if valid is None else key_mask(valid)  # (B, T)
        return self.attend_long(q, k, v, kv)

    def attend_long(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor) -> Tensor:
        """q, k, v (B, h, T, d_k), kv (B, T) -> (B, h, T, d_k): dilated heads' residue classes
        folded into the batch (a band), blocks of w queries against 3 key blocks plus the global
        keys, then the global frames' rows against all keys."""
        B, h, T, _ = q.shape
        g = self.global_every
        frames = torch.arange(T, device=q.device)
        glob = frames % g == 0 if g else frames < 0  # (T,) the global frames (none for g = 0)
        # (G,) their positions, G = ceil(T / g) known from T (no nonzero: no host read)
        gpos = torch.arange(0, T, g, device=q.device) if g else frames[:0]
        glob = glob.expand(B, T)
        outs, p = [], self.dropout_p
        for heads, step in self.head_steps():
            qh, kh, vh = q[:, heads], k[:, heads], v[:, heads]  # (B, H, T, d_k)
            # the global keys and values, repeated for each of the `step` residue classes
            kg = kh[:, :, gpos].repeat_interleave(step, 0)  # (B step, H, G, d_k)
            vg = vh[:, :, gpos].repeat_interleave(step, 0)
            kvg = kv[:, gpos].repeat_interleave(step, 0)  # (B step, G)
            kvh, globh = kv, glob
            if step > 1:  # residue classes mod delta into the batch: the window becomes a band
                qh, kh, vh = (_fold_classes(t, step, 2) for t in (qh, kh, vh))  # (B step, H, m, d)
                kvh, globh = _fold_classes(kv, step, 1), _fold_classes(glob, step, 1)  # (B step, m)
            out = band_global_kernel(qh, kh, vh, kvh, globh, kg, vg, kvg, self.window, p)
            outs.append(_unfold_classes(out, step, T) if step > 1 else out)  # (B, H, T, d_k)
        out = torch.cat(outs, dim=1)  # (B, h, T, d_k)
        if not g:
            return out
        # Global frames attend to every allowed key, in every head.
        mask = kv[:, None, None, :]  # (B, 1, 1, T)
        out_g = self.sdpa(q[:, :, gpos], k, v, mask)
        # Their rows replace the first frame of every group of g (an index_copy's backward
        # trips AOTAutograd's functionalization in torch 2.11 under torch.compile).
        groups = _blocks(out, g)  # (B, h, G, g, d_k)
        out = torch.cat([out_g[:, :, :, None], groups[:, :, :, 1:]], dim=3)
        return out.flatten(2, 3)[:, :, :T]  # (B, h, T, d_k)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        scores = q @ k.transpose(-1, -2) * scale(self.head_dim)  # (B, h, T, T)
        return self.weigh(scores, self.pattern(valid), v)
