"""Synthesizer attention: `syn_dense`, `syn_dense_mh`, `syn_random`, `syn_fixed`.

Tay et al., "Synthesizer: Rethinking Self-Attention in Transformer Models", ICML 2021
(arXiv:2005.00743): attention weights are produced without query-key interaction.

* syn_dense: one logit row per frame, B_i = W_2 ReLU(W_1 x_i) in R^{l_max}, sliced to the
  first T columns and shared by all heads; Y = softmax(B) V (V split into heads as usual).
* syn_dense_mh: the same per head, W_1^i (D -> d_k), W_2^i (d_k -> l_max).
* syn_random: a learned l_max x l_max logit matrix R^i per head, sliced to T x T;
  Y^i = softmax(R^i) V^i, independent of the input.
* syn_fixed (the study's proposal): syn_random whose first 7 heads start from the fixed
  patterns of Raganato, Scherrer, Tiedemann, "Fixed Encoder Self-Attention Patterns in
  Transformer-Based Machine Translation", Findings of EMNLP 2020 (current, previous, next,
  left context, right context, start, end) as logits log(pattern + eps), the rest random.
  The "end" head is read from the bottom-right corner of its matrix, aligned with each
  utterance's own last valid frame, and "start" from its own first valid frame.

Rows are always normalised over the T valid keys only. T > max_len raises a ValueError.
Dense synthesizers use SDPA: logits are the inner products of [ReLU(W_1 x_i), 1] with
[W_2 row j, b_2 j], so the fused kernel never stores the T x T weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.base import Attention, AttentionConfig, key_mask, masked_softmax
from speechattn.attention.registry import register


def _check_len(name: str, T: int, max_len: int) -> None:
    if T > max_len:
        raise ValueError(
            f"{name}: sequence length T={T} exceeds max_len={max_len}; "
            f"set attention.options.max_len >= {T} (or crop the input)"
        )


@dataclass
class SynDenseConfig(AttentionConfig):
    max_len: int = 1024  # l_max, longest sequence; logits are sliced to T
    hidden: int | None = None  # width of W_1; None: D (syn_dense) / d_k per head (syn_dense_mh)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"hidden must be >= 1 or None, got {self.hidden}")


class _SynthesizerBase(Attention):
    """Values projection and metadata shared by the synthesizers."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.max_len = config.max_len
        self.v_proj = nn.Linear(config.dim, config.dim, bias=config.bias)  # W^V

    def keys_attended(self, T: int) -> float:
        return 0.0  # weights are synthesised, no query-key scores (study, Figure 4)


@register("syn_dense")
class SynDenseAttention(_SynthesizerBase):
    """Dense Synthesizer, one weight matrix shared by all heads."""

    Config = SynDenseConfig
    paper = "Tay et al., Synthesizer: Rethinking Self-Attention in Transformer Models, ICML 2021 (Dense)"
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"

    def __init__(self, config: SynDenseConfig) -> None:
        super().__init__(config)
        hidden = config.hidden or config.dim
        self.w1 = nn.Linear(config.dim, hidden, bias=config.bias)  # W_1
        self.w2 = nn.Linear(hidden, config.max_len, bias=config.bias)  # W_2, one row per key

    def _qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits as inner products: q (B, 1, T, H'), k (B, 1, T, H') with H' = hidden (+1)."""
        B, T, _ = x.shape
        _check_len(self.name, T, self.max_len)
        q = F.relu(self.w1(x))  # (B, T, hidden)
        k = self.w2.weight[:T]  # (T, hidden)
        if self.w2.bias is not None:
            q = torch.cat([q, q.new_ones(B, T, 1)], dim=-1)
            k = torch.cat([k, self.w2.bias[:T, None]], dim=-1)
        return q[:, None], k.expand(B, 1, T, -1)

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k = self._qk(x)  # (B, 1, T, H')
        v = self.v_proj(x)[:, None]  # (B, 1, T, D): all heads share the weights
        mask = None if bool(valid.all()) else key_mask(valid)[:, None, None, :]  # (B, 1, 1, T)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)
        return self.split_heads(y[:, 0])  # (B, h, T, d_k)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k = self._qk(x)  # (B, 1, T, H')
        w = masked_softmax(
            q @ k.transpose(-1, -2), key_mask(valid)[:, None, None, :]
        )  # (B, 1, T, T)
        heads = self.drop(w) @ self.split_heads(self.v_proj(x))  # (B, h, T, d_k)
        return heads, w.expand(-1, self.num_heads, -1, -1)


@register("syn_dense_mh")
class SynDenseMHAttention(_SynthesizerBase):
    """Multi-head Dense Synthesizer: W_1^i (D -> d_k), W_2^i (d_k -> l_max) per head."""

    Config = SynDenseConfig
    paper = (
        "Tay et al., Synthesizer: Rethinking Self-Attention in Transformer Models, "
        "ICML 2021 (Dense, multi-head)"
    )
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"

    def __init__(self, config: SynDenseConfig) -> None:
        super().__init__(config)
        h = config.num_heads
        self.hidden = config.hidden or config.head_dim
        self.w1 = nn.Linear(config.dim, h * self.hidden, bias=config.bias)  # W_1^i, all heads
        self.w2 = nn.Parameter(torch.empty(h, config.max_len, self.hidden))  # W_2^i rows
        nn.init.uniform_(self.w2, -(self.hidden**-0.5), self.hidden**-0.5)
        self.b2 = nn.Parameter(torch.zeros(h, config.max_len)) if config.bias else None

    def _qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, h, T, H'), k (B, h, T, H') with H' = hidden (+1 for the bias)."""
        B, T, _ = x.shape
        _check_len(self.name, T, self.max_len)
        q = F.relu(self.w1(x)).view(B, T, self.num_heads, self.hidden).transpose(1, 2)
        k = self.w2[:, :T]  # (h, T, hidden)
        if self.b2 is not None:
            q = torch.cat([q, q.new_ones(B, self.num_heads, T, 1)], dim=-1)
            k = torch.cat([k, self.b2[:, :T, None]], dim=-1)
        return q, k.expand(B, -1, -1, -1)

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        q, k = self._qk(x)  # (B, h, T, H')
        v = self.split_heads(self.v_proj(x))  # (B, h, T, d_k)
        mask = None if bool(valid.all()) else key_mask(valid)[:, None, None, :]  # (B, 1, 1, T)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k = self._qk(x)  # (B, h, T, H')
        w = masked_softmax(
            q @ k.transpose(-1, -2), key_mask(valid)[:, None, None, :]
        )  # (B, h, T, T)
        return self.drop(w) @ self.split_heads(self.v_proj(x)), w


@dataclass
class SynRandomConfig(AttentionConfig):
    max_len: int = 1024  # l_max; each head learns an l_max x l_max logit matrix

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")


@register("syn_random")
class SynRandomAttention(_SynthesizerBase):
    """Random Synthesizer: input-independent learned logits per head."""

    Config = SynRandomConfig
    paper = "Tay et al., Synthesizer: Rethinking Self-Attention in Transformer Models, ICML 2021 (Random)"
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D) (softmax(R) input-independent, cacheable)"

    def __init__(self, config: SynRandomConfig) -> None:
        super().__init__(config)
        n = config.max_len
        self.logits = nn.Parameter(torch.randn(config.num_heads, n, n) / math.sqrt(n))  # R^i

    def sliced_logits(self, valid: Tensor) -> Tensor:
        """R^i sliced to T x T: (1, h, T, T) (subclasses may return (B, h, T, T))."""
        T = valid.shape[1]
        _check_len(self.name, T, self.max_len)
        return self.logits[None, :, :T, :T]

    def weights(self, valid: Tensor) -> Tensor:
        """softmax over the valid keys: (1 or B, h, T, T)."""
        logits = self.sliced_logits(valid)
        if bool(valid.all()):
            return torch.softmax(logits, dim=-1)  # computed once for the whole batch
        return masked_softmax(logits, key_mask(valid)[:, None, None, :])

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        v = self.split_heads(self.v_proj(x))  # (B, h, T, d_k)
        return self.drop(self.weights(valid)) @ v

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights(valid).expand(x.shape[0], -1, -1, -1)  # (B, h, T, T)
        return self.drop(w) @ self.split_heads(self.v_proj(x)), w


@dataclass
class SynFixedConfig(SynRandomConfig):
    context: int = 3  # width of the left/right context patterns
    eps: float = 1e-4  # logits = log(pattern + eps): about -9.2 off-pattern

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context < 1 or not 0 < self.eps < 1:
            raise ValueError(f"need context >= 1 and 0 < eps < 1, got {self.context}, {self.eps}")


@register("syn_fixed")
class SynFixedAttention(SynRandomAttention):
    """Random Synthesizer with the first 7 heads initialised from fixed patterns (the study)."""

    Config = SynFixedConfig
    paper = (
        "Random Synthesizer (Tay et al. 2021) initialised with the fixed patterns of "
        "Raganato et al. 2020; proposed by the study (seeds/001)"
    )

    def __init__(self, config: SynFixedConfig) -> None:
        super().__init__(config)
        n_pat = min(len(patterns.FIXED_PATTERN_NAMES), config.num_heads)
        self.pattern_names = patterns.FIXED_PATTERN_NAMES[:n_pat]
        with torch.no_grad():
            pat = patterns.fixed_patterns(config.max_len, config.context)[:n_pat]
            self.logits[:n_pat] = torch.log(pat + config.eps)

    def sliced_logits(self, valid: Tensor) -> Tensor:
        """(B, h, T, T): "start"/"end" heads aligned with each utterance's first/last valid frame."""
        B, T = valid.shape
        _check_len(self.name, T, self.max_len)
        logits = self.logits[None, :, :T, :T]  # (1, h, T, T)
        if len(self.pattern_names) < 6:
            return logits
        n, pos = self.max_len, torch.arange(T, device=valid.device)
        first = torch.where(valid, pos, T).amin(-1) % T  # (B,), 0 when nothing is valid
        last = torch.where(valid, pos, -1).amax(-1) % T  # (B,), T - 1 when nothing is valid
        heads = list(logits.expand(B, -1, -1, -1).unbind(1))
        for h, offset in ((5, -first), (6, n - 1 - last)):
            if h < len(self.pattern_names):
                idx = (pos[None] + offset[:, None]).clamp(0, n - 1)  # (B, T) rows/cols of R^h
                heads[h] = self.logits[h][idx[:, :, None], idx[:, None, :]]  # (B, T, T)
        return torch.stack(heads, dim=1)
