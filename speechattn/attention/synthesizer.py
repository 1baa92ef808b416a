"""Synthesizer attention: `syn_dense`, `syn_dense_mh`, `syn_random`, `syn_fixed`.

Tay et al., "Synthesizer: Rethinking Self-Attention in Transformer Models", ICML 2021
(arXiv:2005.00743): weights without query-key interaction. `syn_fixed` (the study's proposal)
is `syn_random` whose first 7 heads start from the fixed patterns of Raganato, Scherrer,
Tiedemann, Findings of EMNLP 2020, as logits log(pattern + eps) (`pattern_eps`). Rows are
normalised over the valid keys; columns are placed by frame position (`end_padded_only`).
Options and kernels: docs/attention.md, "Synthesizers".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.autotune import use_short_path
from speechattn.attention.base import (
    Attention,
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    linear_flops,
    masked_softmax,
    needs_static_shapes,
    require,
)
from speechattn.attention.kernels.table import (
    GradientMemory,
    TableAttention,
    TableWindows,
    weighted_values,
)
from speechattn.attention.pruning import remove_projection_heads
from speechattn.attention.registry import register
from speechattn.errors import ConfigError


@dataclass
class SynRandomConfig(AttentionConfig):
    max_len: int = 1024  # l_max, longest sequence: logits (per key, or l_max x l_max) sliced to T

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_len >= 1, f"max_len must be >= 1, got {self.max_len}")


@dataclass
class SynDenseConfig(SynRandomConfig):
    hidden: int | None = None  # width of W_1; None: D (syn_dense) / d_k per head (syn_dense_mh)

    def __post_init__(self) -> None:
        super().__post_init__()
        H = self.hidden
        require(H is None or H >= 1, f"hidden must be >= 1 or None, got {H}")


def _cropped(run: Callable[..., Any]) -> Callable[..., Any]:
    """`run` (`forward` or `dense_reference`) on a batch padded beyond max_len whose utterances
    fit: on its first n <= max_len frames, y (B, n, D) and weights (B, h, n, n) zero-padded to T."""

    @functools.wraps(run)
    def cropped(
        self: _SynthesizerBase,
        x: Tensor,
        padding_mask: Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        n = self._fitting_length(x, padding_mask)
        if n is None:
            return run(self, x, padding_mask, *args, **kwargs)
        out, T = run(self, x[:, :n], padding_mask[:, :n], *args, **kwargs), x.shape[1]
        if isinstance(out, Tensor):
            return F.pad(out, (0, 0, 0, T - n))
        y, w = out
        return F.pad(y, (0, 0, 0, T - n)), F.pad(w, (0, T - n, 0, T - n))

    return cropped


TAY = "Tay et al., Synthesizer: Rethinking Self-Attention in Transformer Models, ICML 2021"


class _SynthesizerBase(Attention):
    """Values projection, length checks and metadata."""

    end_padded_only = True  # positions place the pattern (see `Attention`)
    head_projections = {"v_proj": 1}

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.max_len = config.max_len
        self.v_proj = nn.Linear(config.dim, config.dim, bias=config.bias)  # W^V

    def keys_attended(self, T: int) -> float:
        return 0.0  # weights are synthesised, no query-key scores (study, Figure 4)

    forward = _cropped(Attention.forward)
    dense_reference = _cropped(Attention.dense_reference)

    def _fitting_length(self, x: Tensor, padding_mask: Tensor | None) -> int | None:
        """1 + the last valid frame when x (B, T, D) exceeds max_len (a longer utterance is
        refused); None when x fits or has no mask. A host read, for a batch refused otherwise."""
        T = x.shape[1]
        if T <= self.max_len or padding_mask is None or padding_mask.shape != x.shape[:2]:
            return None
        valid = (~padding_mask).any(0)  # (T,): frames valid in some utterance
        n = int(valid.nonzero().max()) + 1 if bool(valid.any()) else 1
        self._check_len(n)  # the longest utterance must fit
        return n

    def _check_len(self, T: int) -> None:
        if T > self.max_len:
            raise ConfigError(
                f"{self.name}: sequence length T={T} exceeds max_len={self.max_len}; "
                f"set attention.options.max_len >= {T} (or crop the input)"
            )

    def value_flops(self, T: int) -> float:
        """V projection, the (T x T) weights x V product of all heads, output projection."""
        E = self.inner_dim  # h d_k, D unless pruned
        return linear_flops(T, self.dim, E) + 2.0 * T * T * E + self.output_flops(T)


class _DenseSynthesizer(_SynthesizerBase):
    """Dense synthesizers: logits [ReLU(W_1 x_i), 1] . [W_2 row j, b_2 j] with the subclass's
    `logit_table()`, W_2 (G, l_max, hidden) and b_2 (G, l_max) or None, G = 1 (one logit
    matrix for all heads) or h."""

    Config = SynDenseConfig
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
        """softmax(q k^T) v over the valid keys by SDPA with scale 1, zero-padding q/k or v to
        one head size (else the CPU takes the T x T math path)."""
        mask = None if valid is None else key_mask(valid)[:, None, None, :]  # (B, 1, 1, T)
        dq, dv = q.shape[-1], v.shape[-1]
        if dq > dv:
            v = F.pad(v, (0, dq - dv))
        elif dv > dq:
            q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
        p = self.dropout_p
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)
        return y[..., :dv]

    def flops(self, T: int) -> Flops:
        """W_1 and one (T, T) logit matrix per logit group, then the values."""
        W2, _ = self.logit_table()  # (G, l_max, hidden)
        G, hidden = W2.shape[0], W2.shape[-1]
        logits = G * linear_flops(T, hidden, T)
        return Flops(linear_flops(T, self.dim, G * hidden) + logits + self.value_flops(T))

    def _qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits as inner products: q, k (B, G, T, H'), H' = hidden (+1 for the bias)."""
        B, T, _ = x.shape
        self._check_len(T)
        W2, b2 = self.logit_table()
        G = W2.shape[0]
        q = F.relu(self.w1(x)).view(B, T, G, -1).transpose(1, 2)  # (B, G, T, hidden)
        k = W2[:, :T]  # (G, T, hidden)
        if b2 is not None:
            q = torch.cat([q, q.new_ones(B, G, T, 1)], dim=-1)
            k = torch.cat([k, b2[:, :T, None]], dim=-1)
        return q, k.expand(B, -1, -1, -1)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Weights from `_qk`'s logits, (B, G, T, T) expanded to (B, h, T, T)."""
        q, k = self._qk(x)  # (B, 1 or h, T, H')
        w = masked_softmax(q @ k.transpose(-1, -2), key_mask(valid)[:, None, None, :])
        heads = self.drop(w) @ self.split_heads(self.v_proj(x))  # (B, h, T, d_k)
        return heads, w.expand(-1, self.num_heads, -1, -1)


@register("syn_dense")
class SynDenseAttention(_DenseSynthesizer):
    """Dense Synthesizer: B_i = W_2 ReLU(W_1 x_i) in R^{l_max}, sliced to the first T
    columns and shared by all heads; Y = softmax(B) V."""

    paper = f"{TAY} (Dense)"

    def __init__(self, config: SynDenseConfig) -> None:
        super().__init__(config)
        hidden = config.hidden or config.dim
        self.w1 = nn.Linear(config.dim, hidden, bias=config.bias)  # W_1
        self.w2 = nn.Linear(hidden, config.max_len, bias=config.bias)  # W_2, one row per key

    def logit_table(self) -> tuple[Tensor, Tensor | None]:
        bias = self.w2.bias
        return self.w2.weight[None], None if bias is None else bias[None]

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k = self._qk(x)  # (B, 1, T, H')
        v = self.v_proj(x)[:, None]  # (B, 1, T, D): all heads share the weights
        return self.split_heads(self._sdpa(q, k, v, valid)[:, 0])  # (B, h, T, d_k)


@register("syn_dense_mh")
class SynDenseMHAttention(_DenseSynthesizer):
    """Multi-head Dense Synthesizer: W_1^i (D -> d_k), W_2^i (d_k -> l_max) per head."""

    paper = f"{TAY} (Dense, multi-head)"
    no_weight_decay = ("b2",)  # the per-head bias of W_2
    head_tensors = ("w2", "b2")

    def __init__(self, config: SynDenseConfig) -> None:
        super().__init__(config)
        h = config.num_heads
        self.hidden = config.hidden or config.head_dim
        self.w1 = nn.Linear(config.dim, h * self.hidden, bias=config.bias)  # W_1^i, all heads
        self.w2 = nn.Parameter(torch.empty(h, config.max_len, self.hidden))  # W_2^i rows
        nn.init.uniform_(self.w2, -(self.hidden**-0.5), self.hidden**-0.5)
        self.b2 = nn.Parameter(torch.zeros(h, config.max_len)) if config.bias else None

    def _remove_heads(self, index: Tensor) -> None:
        remove_projection_heads(self, self.w1, index, size=self.hidden)

    def logit_table(self) -> tuple[Tensor, Tensor | None]:
        return self.w2, self.b2

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k = self._qk(x)  # (B, h, T, H')
        return self._sdpa(q, k, self.split_heads(self.v_proj(x)), valid)  # (B, h, T, d_k)


@register("syn_random")
class SynRandomAttention(_SynthesizerBase):
    """Random Synthesizer: a learned l_max x l_max logit matrix R^i per head, sliced to
    T x T; Y^i = softmax(R^i) V^i, independent of the input."""

    Config = SynRandomConfig
    paper = f"{TAY} (Random)"
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D) (softmax(R) input-independent, cacheable)"
    short_path_max_t = 768  # explicit (G, h, T, T) weights up to here, TableAttention above
    head_tensors = ("logits",)

    def __init__(self, config: SynRandomConfig) -> None:
        super().__init__(config)
        n = config.max_len
        self.logits = nn.Parameter(torch.empty(config.num_heads, n, n).normal_(std=n**-0.5))  # R^i
        self.gradient_memory = GradientMemory()  # reused memory of the logits' gradient

    def flops(self, T: int) -> Flops:
        return Flops(self.value_flops(T))  # the logits are a parameter: no product at all

    def offsets(self, valid: Tensor | None, T: int) -> Tensor:
        """(G, h) first row/column of each head's T x T slice of R, G = 1 or B, on the host."""
        return torch.zeros(1, self.num_heads, dtype=torch.long)

    def window_logits(self, valid: Tensor | None, T: int) -> Tensor:
        """R^i sliced to T x T at `offsets`' places by device ops: (G, h, T, T), G = 1 or B."""
        return self.logits[None, :, :T, :T]

    def weights(self, valid: Tensor | None, T: int) -> Tensor:
        """softmax over the valid keys (valid None: all T): (1 or B, h, T, T)."""
        self._check_len(T)
        if needs_static_shapes(self.logits):
            logits = self.window_logits(valid, T)  # (G, h, T, T)
        else:
            if valid is not None and bool(valid.all()):
                valid = None  # a free read on the CPU: one softmax for the whole batch
            offsets = self.offsets(valid, T)
            logits = TableWindows.apply(self.logits, offsets, T, self.gradient_memory)
        if valid is None:
            return torch.softmax(logits, dim=-1)
        return masked_softmax(logits, key_mask(valid)[:, None, None, :])

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        v = self.split_heads(self.v_proj(x))  # (B, h, T, d_k)
        T = x.shape[1]
        # the row-chunked table kernel for long sequences on CPU eager without dropout
        if needs_static_shapes(x) or use_short_path(self, x) or (self.dropout and self.training):
            return weighted_values(self.drop(self.weights(valid, T)), v)
        self._check_len(T)
        valid = all_valid(x) if valid is None else valid
        return TableAttention.apply(
            self.logits, self.offsets(valid, T), v, key_mask(valid), self.gradient_memory
        )

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights(valid, x.shape[1]).expand(x.shape[0], -1, -1, -1)  # (B, h, T, T)
        return self.drop(w) @ self.split_heads(self.v_proj(x)), w


@dataclass
class SynFixedConfig(SynRandomConfig):
    context: int = 3  # width of the left/right context patterns
    init_mass: float = 0.99  # each row's initial weight on its pattern at T = max_len (or less)
    # Initial logits log(pattern + eps); None: `pattern_eps` (the first runs' fixed 1e-4 gave a
    # mass falling with T: 0.55 at T = 8192)
    eps: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        c, m, eps = self.context, self.init_mass, self.eps
        require(c >= 1 and 0 < m < 1, f"need context >= 1 and 0 < init_mass < 1, got {c}, {m}")
        require(eps is None or 0 < eps < 1, f"need 0 < eps < 1 (or None), got {eps}")


def pattern_eps(init_mass: float, max_len: int) -> float:
    """eps with which a pattern row holds `init_mass` m of its weight at T = max_len valid keys:
    a row putting 1/k on k keys holds (1 + k eps) / (1 + T eps) >= m for every k >= 1 and
    T <= max_len when eps = (1 - m) / (m max_len - 1) (1 when a single key makes every mass 1);
    m = 0.99, max_len = 1024: 9.9e-6 (logits -11.5 off the pattern)."""
    m = init_mass
    return (1 - m) / (m * max_len - 1) if m * max_len > 1 else 1.0


@register("syn_fixed")
class SynFixedAttention(SynRandomAttention):
    """Random Synthesizer with the first 7 heads initialised from fixed patterns (the study)."""

    Config = SynFixedConfig
    paper = (
        "Random Synthesizer (Tay et al. 2021) initialised with the fixed patterns of "
        "Raganato et al. 2020; proposed by the attention study"
    )

    def __init__(self, config: SynFixedConfig) -> None:
        super().__init__(config)
        eps = config.eps
        self.eps = pattern_eps(config.init_mass, config.max_len) if eps is None else eps
        self.pattern_names = patterns.FIXED_PATTERN_NAMES[: config.num_heads]
        # the pattern each head started from (None: random), by current head index
        self.head_patterns: list[str | None] = [*self.pattern_names]
        self.head_patterns += [None] * (config.num_heads - len(self.pattern_names))
        with torch.no_grad():  # one head at a time: l_max = 8192 stays affordable
            for i, name in enumerate(self.pattern_names):
                pat = patterns.fixed_pattern(name, config.max_len, config.context)
                self.logits[i] = pat.add_(self.eps).log_()

    def _remove_heads(self, index: Tensor) -> None:
        self.head_patterns = [self.head_patterns[i] for i in index.tolist()]

    def offsets(self, valid: Tensor | None, T: int) -> Tensor:
        """(G, h) on the host: the "end" head's window puts each utterance's last valid frame at
        R's bottom-right corner (G = 1 when all agree, else B); the others start top-left."""
        offs = super().offsets(valid, T)
        if "end" not in self.head_patterns:
            return offs
        end = self.head_patterns.index("end")  # head 6 unless pruned
        if valid is None:
            offs[:, end] = self.max_len - T  # frame T - 1 -> row/col n - 1
            return offs
        offs = offs.repeat(valid.shape[0], 1)  # (B, h)
        offs[:, end] = (self.max_len - 1 - self._last_valid(valid)).cpu()
        return offs[:1] if bool((offs == offs[:1]).all()) else offs

    @staticmethod
    def _last_valid(valid: Tensor) -> Tensor:
        """(B,) index of each utterance's last valid frame (T - 1 when it has none)."""
        T = valid.shape[1]
        return torch.where(valid, torch.arange(T, device=valid.device), -1).amax(-1) % T

    def window_logits(self, valid: Tensor | None, T: int) -> Tensor:
        """`offsets`' windows by device ops: (1, h, T, T) unpadded, (B, h, T, T) padded; the "end"
        window is R's bottom-right corner shifted by T - 1 - last_b, zeros past the edge."""
        logits = super().window_logits(valid, T)  # (1, h, T, T), top-left windows
        if "end" not in self.head_patterns:
            return logits
        end = self.head_patterns.index("end")  # head 6 unless pruned
        o = self.max_len - T
        corner = self.logits[end, o:, o:]  # (T, T): frame T - 1 meets row/col n - 1
        if valid is None:
            head = corner[None, None]  # (1, 1, T, T)
        else:
            B = valid.shape[0]
            d = T - 1 - self._last_valid(valid)  # (B,) padded frames at the end
            idx = torch.arange(T, device=valid.device) + d[:, None]  # (B, T), <= 2T - 2
            padded = F.pad(corner, (0, T - 1, 0, T - 1))  # (2T - 1, 2T - 1)
            head = padded[idx[:, :, None], idx[:, None, :]][:, None]  # (B, 1, T, T)
            logits = logits.expand(B, -1, -1, -1)
        return torch.cat([logits[:, :end], head, logits[:, end + 1 :]], dim=1)
