"""The attention contract: config, the abstract class `Attention`, and helpers for variants.

Shape letters (used in every docstring and shape comment of `speechattn.attention`):

    B    batch size
    T    frames (sequence length, padded)
    D    model dim (``dim``)
    h    heads (``num_heads``)
    d_k  per-head dim, D / h
    k    keys kept per query (LSH top-k), c context width (LDSA) or summary columns (sparse)
    l    block size / stride of the sparse patterns, n = ceil(T / l) blocks

A variant implements `attend` (efficient, -> (B, h, T, d_k)) and `attend_dense` (the reference,
explicit (B, h, T, T) weights); `Attention.forward` does the rest: checks, zeroed padding, the
head mask xi (Michel et al. 2019: head h's output times xi_h before W^O), the output projection.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention.kernels.memory import lazy_zeros
from speechattn.errors import ConfigError, SpeechattnError

# Additive score on the diagonal for shared-QK attention (Reformer): a query attends to
# itself only when it has no other valid key. Finite, unlike -inf, so such rows stay defined.
SELF_PENALTY = -5e4


class PaddingMaskError(SpeechattnError, ValueError):
    """Padded frames before an utterance's first valid frame, for an `end_padded_only` variant."""


def check_no_leading_padding(padding_mask: Tensor, name: str) -> None:
    """Refuse a padding mask (B, T) with padded frames before an utterance's first valid frame
    (a host read: callers skip it off CPU eager, where masks come from lengths)."""
    leading = padding_mask[:, 0] & ~padding_mask.all(-1)  # (B,): padded first, valid later
    if bool(leading.any()):
        b = int(leading.nonzero()[0])
        first = int((~padding_mask[b]).nonzero()[0])
        raise PaddingMaskError(
            f"{name}: padding_mask row {b} starts with {first} padded frames before its first "
            f"valid frame; {name} places its pattern by frame position, counted from frame 0, "
            "so padding must come after each utterance's first frame (pad at the end, e.g. "
            "speechattn.utils.lengths_to_padding_mask), or use a variant that takes any padding"
        )


@dataclass(frozen=True)
class Flops:
    """FLOPs of one forward pass over T frames, matrix products only, 2 per multiply-add:
    differentiable (a backward of about twice its cost) and no_grad (LSH hashing)."""

    differentiable: float
    no_grad: float = 0.0

    @property
    def training(self) -> float:
        return 3 * self.differentiable + self.no_grad

    @property
    def inference(self) -> float:
        return self.differentiable + self.no_grad


def linear_flops(T: int, d_in: int, d_out: int) -> float:
    return 2.0 * T * d_in * d_out


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class AttentionConfig:
    """Options shared by every variant; each variant's config extends this one."""

    dim: int  # D
    num_heads: int  # h, dividing D
    dropout: float = 0.0  # on attention probabilities (training only)
    bias: bool = True  # in the input/output projections
    layer: int = 0  # depth in the encoder (0: shared layer); seeds fixed random parameters

    def __post_init__(self) -> None:
        D, h = self.dim, self.num_heads
        require(D > 0 and h > 0, f"dim and num_heads must be positive, got {D}, {h}")
        require(D % h == 0, f"dim={D} is not divisible by num_heads={h}")
        require(self.layer >= 0, f"layer must be >= 0, got {self.layer}")
        require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


class Attention(nn.Module, ABC):
    """Multi-head self-attention with one fixed signature, and each variant's metadata."""

    Config: ClassVar[type[AttentionConfig]] = AttentionConfig
    name: ClassVar[str] = ""  # registry name (set by `registry.register`)
    paper: ClassVar[str] = ""  # citation of the mechanism
    complexity_training: ClassVar[str] = ""  # theoretical time cost (study, Table 1)
    complexity_inference: ClassVar[str] = ""
    supports_weights: ClassVar[bool] = True  # `need_weights=True` returns (B, h, T, T) weights
    # Two-kernel variants: the all-pairs "short" kernel up to this T, the "long" one above
    # (measured crossover); None: one kernel, or other names (`kernel_names`).
    short_path_max_t: ClassVar[int | None] = None
    # Kernels forming (B, h, T, T) scores or masks: timed only while those fit the budget.
    all_pairs_kernels: ClassVar[tuple[str, ...]] = ("short",)
    no_weight_decay: ClassVar[tuple[str, ...]] = ()  # per-head bias matrices, left undecayed
    # What `pruning.prune_heads` cuts per head: Linear layers {name: blocks} with outputs
    # blocks x h x d_k (3: a fused W^Q | W^K | W^V), and tensors with one entry per head in dim 0.
    head_projections: ClassVar[dict[str, int]] = {}
    head_tensors: ClassVar[tuple[str, ...]] = ()
    input_projections: ClassVar[int] = 3  # W^Q, W^K, W^V (2 with shared QK), for `flops`
    # The pattern is placed by frame position: a mask padding before frame 0 is refused.
    end_padded_only: ClassVar[bool] = False
    max_len: int | None = None  # longest T accepted; None: any
    autotune: bool = False  # kernel choice by measurement (`autotune.enable`); off: the rule
    _forced_kernel: str | None = None  # the kernel the tuner is timing (`autotune.forced`)

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.out_proj = nn.Linear(config.dim, config.dim, bias=config.bias)  # W^O
        self.kept_heads: list[int] = list(range(config.num_heads))  # original indices
        self._kernel_memo: dict[tuple, str] = {}  # measured choices: key -> kernel name
        self.kernel_choices: dict[str, dict] = {}  # the same, readable, for run metadata

    @property
    def complexity(self) -> str:
        return f"training {self.complexity_training}; inference {self.complexity_inference}"

    def keys_attended(self, T: int) -> float:
        """Average number of frames whose value each query weighs at T valid frames (the study's
        Figure 4): here all T keys it scores."""
        return float(T)

    def flops(self, T: int) -> Flops:
        """FLOPs at T valid frames, W^O included: here dot products with `keys_attended(T)` keys."""
        return self.dot_product_flops(T, self.keys_attended(T))

    @property
    def inner_dim(self) -> int:
        """h d_k, the width of all heads together: D, or less after `pruning.prune_heads`."""
        return self.num_heads * self.head_dim

    def output_flops(self, T: int) -> float:
        return linear_flops(T, self.inner_dim, self.dim)

    def dot_product_flops(self, T: int, keys: float) -> Flops:
        """Input projections, scores and weighted sums over `keys` keys per query, and W^O."""
        E, projections = self.inner_dim, self.input_projections
        attention = 2 * 2.0 * T * keys * E
        return Flops(linear_flops(T, self.dim, projections * E) + attention + self.output_flops(T))

    def auxiliary_loss(self) -> Tensor | None:
        """A term pretraining adds to the loss once per module (adaptive_span)."""
        return None

    def after_optimizer_step(self) -> None:
        """Puts parameters back into their range after each optimiser step (adaptive_span)."""

    # Kernel choice hooks, asked by `autotune.pick_kernel`.
    @property
    def kernel_names(self) -> tuple[str, ...]:
        """Every kernel this module may run: ("short", "long") with a crossover, else ("one",)."""
        return ("short", "long") if self.short_path_max_t is not None else ("one",)

    def kernel_candidates(self, t: Tensor) -> tuple[str, ...]:
        """Kernels the tuner may time for t (x (B, T, D) or q (B, h, T, d_k)); () when no choice."""
        names = self.kernel_names
        return names if len(names) > 1 else ()

    def rule_kernel(self, T: int, device: torch.device) -> str:
        """The kernel at T frames on `device` without measurement."""
        if self.short_path_max_t is None:
            return self.kernel_names[0]
        return "short" if T <= self.short_path_max_t else "long"

    @abstractmethod
    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        """Efficient path: x (B, T, D) with padded frames zeroed, valid (B, T) bool or None when
        nothing is padded (known on the host) -> (B, h, T, d_k), padded rows any finite value."""

    @abstractmethod
    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Reference path with explicit weights: (heads (B, h, T, d_k), weights (B, h, T, T))."""

    def _remove_heads(self, index: Tensor) -> None:
        """Keep only heads `index` (sorted, long) of per-head state beyond `head_projections`
        and `head_tensors`; called by `pruning.prune_heads` before `num_heads` changes."""

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        head_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, D), padding_mask (B, T) True at padding, head_mask xi (h,) (differentiable:
        head importance uses dL/dxi) -> y (B, T, D) zero at padding; with need_weights
        (y, weights (B, h, T, T)) from the dense reference."""
        if need_weights:
            return self.dense_reference(x, padding_mask, head_mask)
        x, valid = self._prepare(x, padding_mask, head_mask)
        return self._project(self.attend(x, valid), valid, head_mask)

    def dense_reference(
        self, x: Tensor, padding_mask: Tensor | None = None, head_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Same as `forward` through explicit (B, h, T, T) weights: returns (y, weights)."""
        if not self.supports_weights:
            raise NotImplementedError(f"{self.name} cannot return attention weights")
        x, valid = self._prepare(x, padding_mask, head_mask)
        valid = all_valid(x) if valid is None else valid
        heads, weights = self.attend_dense(x, valid)
        weights = weights * valid[:, None, :, None]  # padded queries: zero rows
        return self._project(heads, valid, head_mask), weights

    def _prepare(
        self, x: Tensor, padding_mask: Tensor | None, head_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Checked x with padded frames zeroed, and valid (B, T) bool (None: no padding)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{self.name}: expected x of shape (B, T, {self.dim}), got {tuple(x.shape)}"
            )
        B, T, _ = x.shape
        if T < 1:
            raise ValueError(f"{self.name}: expected T >= 1 frames, got {T}")
        valid = None
        if padding_mask is not None:
            if padding_mask.shape != (B, T) or padding_mask.dtype != torch.bool:
                raise ValueError(
                    f"{self.name}: expected padding_mask bool (B, T) = ({B}, {T}), "
                    f"got {padding_mask.dtype} {tuple(padding_mask.shape)}"
                )
            if self.end_padded_only and not needs_static_shapes(padding_mask):
                check_no_leading_padding(padding_mask, self.name)
            valid = ~padding_mask
            x = x.masked_fill(padding_mask[..., None], 0.0)  # padded content never matters
        if head_mask is not None and head_mask.shape != (self.num_heads,):
            raise ValueError(
                f"{self.name}: expected head_mask of shape ({self.num_heads},), got {tuple(head_mask.shape)}"
            )
        return x, valid

    def _project(self, heads: Tensor, valid: Tensor | None, head_mask: Tensor | None) -> Tensor:
        """heads (B, h, T, d_k) -> xi-scaled, merged, projected y (B, T, D), zero at padding."""
        B, h, T, dk = heads.shape
        if head_mask is not None:
            heads = heads * head_mask.to(heads.dtype).view(1, h, 1, 1)
        y = self.out_proj(heads.transpose(1, 2).reshape(B, T, h * dk))  # (B, T, D)
        return y if valid is None else y.masked_fill(~valid[..., None], 0.0)

    def split_heads(self, t: Tensor) -> Tensor:
        """(B, T, D) -> (B, h, T, d_k)."""
        B, T, _ = t.shape
        return t.view(B, T, self.num_heads, -1).transpose(1, 2)

    @property
    def dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def drop(self, probs: Tensor) -> Tensor:
        return F.dropout(probs, self.dropout, self.training) if self.dropout else probs

    def weigh(self, scores: Tensor, allowed: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The dense references' last step: weights = softmax of scores (B, h, T, T) over
        `allowed` -> (dropped weights @ v (B, h, T, d_k), weights)."""
        weights = masked_softmax(scores, allowed)
        return self.drop(weights) @ v, weights

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """Fused SDPA with this pass's dropout: q (B, h, T, d), mask bool/additive or None."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p)

    def extra_repr(self) -> str:
        pruned = "" if self.num_heads == self.config.num_heads else f", kept={self.kept_heads}"
        return f"name={self.name!r}, dim={self.dim}, num_heads={self.num_heads}{pruned}"


class _UnitKeys(torch.autograd.Function):
    """F.normalize's forward with a backward of seven tensor operations (autograd's of
    F.normalize takes fifteen, each a pass over (B, h, T, d_k): a few per cent of a layer at
    T = 128)."""

    @staticmethod
    def forward(ctx, q: Tensor) -> Tensor:
        norm = q.norm(dim=-1, keepdim=True)
        n = norm.clamp_min(1e-12)
        k = q / n
        ctx.save_for_backward(k, n, norm)
        return k

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        k, n, norm = ctx.saved_tensors
        # d(q/n)/dq = (I - k k^T) / n; where the norm is clamped, n is a constant: I / n
        along = (g * k).sum(-1, keepdim=True) * (norm >= 1e-12)
        return (g - k * along) / n


def unit_keys(q: Tensor) -> Tensor:
    """Shared-QK keys q / max(||q||, 1e-12): F.normalize's values bit for bit, cheaper."""
    return _UnitKeys.apply(q)


def all_valid(x: Tensor) -> Tensor:
    """valid (B, T) all True for x (B, T, ...), for kernels that need a mask when valid is None."""
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


def key_mask(valid: Tensor) -> Tensor:
    """Keys a query may use: valid (B, T) -> (B, T) bool; a sequence without any valid frame
    lets its (zeroed) queries use every key, so that no softmax row is empty (NaN)."""
    return valid | ~valid.any(dim=-1, keepdim=True)


def masked_softmax(scores: Tensor, allowed: Tensor, dim: int = -1) -> Tensor:
    """Softmax over `allowed` entries only, exactly 0 elsewhere; a row without any allowed
    entry (only padded queries, zeroed later) becomes uniform instead of NaN."""
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=dim)


def self_penalty(T: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(T, T) with SELF_PENALTY on the diagonal, lazily zeroed (torch.eye writes all T^2)."""
    penalty = lazy_zeros((T, T), dtype, device)
    penalty.diagonal().fill_(SELF_PENALTY)
    return penalty


def needs_static_shapes(t: Tensor) -> bool:
    """Whether shapes and control flow must not depend on t's data: off the CPU (a host read
    waits for the device) and under torch.compile (a graph break); on CPU eager a read is free."""
    return t.device.type != "cpu" or torch.compiler.is_compiling()


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype kernels on t compute in: autocast's when it is on for t's device."""
    kind = t.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


def widen(t: Tensor) -> Tensor:
    """Half-precision tensors to float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def layer_seed(seed: int, layer: int, *more: int) -> int:
    """Seed of a module's fixed random parameters: unrelated across layers, `seed` and `more`."""
    return int(np.random.SeedSequence([seed, layer, *more]).generate_state(1, np.uint64)[0] >> 1)


def scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
