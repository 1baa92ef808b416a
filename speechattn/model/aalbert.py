"""AALBERT: an ALBERT-style transformer encoder over stacked log-mel frames.

Audio ALBERT (Chi et al., 2020) is Mockingjay with ALBERT's cross-layer parameter sharing: one
transformer layer applied L times, here around any attention variant of `speechattn.attention`.
Shape letters: B batch, T 10 ms mel frames, T' stacked 30 ms model frames, F mel bins, D model
dim, h heads, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from speechattn.attention.base import Attention
from speechattn.attention.pruning import prune_heads
from speechattn.data.features import stack_frames
from speechattn.errors import ConfigError, is_int, is_number, require
from speechattn.utils import lengths_to_padding_mask


def sinusoidal_positions(length: int, dim: int, device=None, dtype=None) -> Tensor:
    """Vaswani et al. sine/cosine positions (length, dim), computed on the fly (no max length);
    odd dim has one more sine column."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]  # (T', 1)
    freq = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )  # (ceil(D/2),)
    table = torch.zeros(length, dim, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table.to(dtype or torch.float32)


class ConvPositions(nn.Module):
    """h + GELU(conv(h)), a grouped convolution over time (wav2vec 2.0's positional conv): local
    order that short runs fail to learn from absolute sinusoids (docs/tiny_study.md)."""

    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()  # kernel odd and groups dividing dim: checked by ModelConfig
        self.conv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=groups)

    def forward(self, h: Tensor, padding_mask: Tensor | None) -> Tensor:
        """h (B, T', D), padding_mask (B, T') True at padding -> (B, T', D)."""
        if padding_mask is not None:  # padded frames read as zeros, like the sequence's ends
            h = h.masked_fill(padding_mask[..., None], 0.0)
        return h + F_.gelu(self.conv(h.transpose(1, 2)).transpose(1, 2))


class InputEmbedding(nn.Module):
    """Stacked frames -> Linear -> + sinusoidal positions [-> + conv positions] -> LayerNorm
    -> dropout (Mockingjay; the convolutional positions are an option, off by default)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(c.input_dim, c.dim)
        self.position_scale = c.position_scale
        self.conv_positions = (
            ConvPositions(c.dim, c.conv_position_kernel, c.conv_position_groups)
            if c.conv_position_kernel
            else None
        )
        self.norm = nn.LayerNorm(c.dim, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """x (B, T', stack*F), padding_mask (B, T') True at padding -> (B, T', D)."""
        h = self.proj(x)
        positions = sinusoidal_positions(x.shape[1], h.shape[-1], device=h.device, dtype=h.dtype)
        h = h + self.position_scale * positions
        if self.conv_positions is not None:
            h = self.conv_positions(h, padding_mask)
        return self.dropout(self.norm(h))


class FeedForward(nn.Module):
    """Position-wise Linear -> GELU -> dropout -> Linear (BERT intermediate + output)."""

    def __init__(self, dim: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T', D) -> (B, T', D)."""
        return self.fc2(self.dropout(F_.gelu(self.fc1(x))))


class EncoderLayer(nn.Module):
    """One transformer layer around a given attention module: post-LN (BERT, AALBERT's)
    x = LN(x + attn(x)); x = LN(x + ffn(x)), or pre-LN (stabler when deep) x = x + attn(LN(x));
    x = x + ffn(LN(x)) (the encoder then adds a final LayerNorm)."""

    def __init__(self, attention: nn.Module, c: ModelConfig) -> None:
        super().__init__()
        self.attention = attention
        self.attn_norm = nn.LayerNorm(c.dim, eps=c.layer_norm_eps)
        self.ffn = FeedForward(c.dim, c.ffn_dim, c.dropout)
        self.ffn_norm = nn.LayerNorm(c.dim, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)
        self.pre_norm = c.pre_norm

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None,
        head_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T', D), padding_mask (B, T') True at padding, head_mask (h,) -> (B, T', D), and
        with need_weights the weights (B, h, T', T') (without, one tensor: s3prl's hooks
        collect it as the layer's hidden state)."""
        a_in = self.attn_norm(x) if self.pre_norm else x
        out = self.attention(a_in, padding_mask, head_mask=head_mask, need_weights=need_weights)
        a, weights = out if need_weights else (out, None)
        x = x + self.dropout(a)
        if not self.pre_norm:
            x = self.attn_norm(x)
        f_in = self.ffn_norm(x) if self.pre_norm else x
        x = x + self.dropout(self.ffn(f_in))
        if not self.pre_norm:
            x = self.ffn_norm(x)
        return (x, weights) if need_weights else x


class Encoder(nn.Module):
    """L applications of one shared layer or of L layers (`depth_to_layer[i]` runs at depth i),
    each depth with its own row xi of the (L, h) head mask (Michel et al., 2019).

    After pruning (`AALBERT.prune_heads`) the head mask keeps its shape over the original
    heads: each depth's attention gets its `kept_heads`' entries, times `residual_head_mask`.
    """

    def __init__(self, layers: list[EncoderLayer], num_layers: int, final_norm: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.num_layers = num_layers
        self.depth_to_layer = [0] * num_layers if len(layers) == 1 else list(range(num_layers))
        self.final_norm = final_norm  # Identity for post-LN
        self.residual_head_mask: Tensor | None  # (L, h), from the model config; not saved
        self.register_buffer("residual_head_mask", None, persistent=False)

    def _depth_head_mask(self, head_mask: Tensor | None, depth: int) -> Tensor | None:
        """xi of depth `depth` for its layer's remaining heads: (L, h) row -> (h',) or None."""
        row = None if head_mask is None else head_mask[depth]
        if self.residual_head_mask is not None:
            residual = self.residual_head_mask[depth]
            row = residual if row is None else row * residual.to(row)
        attention = self.layers[self.depth_to_layer[depth]].attention
        kept, h = getattr(attention, "kept_heads", None), attention.config.num_heads
        if row is None or kept is None or len(kept) == h:
            return row
        if row.shape[0] != h:
            raise ValueError(
                f"head_mask must be (L={self.num_layers}, h={h}) over the heads before "
                f"pruning, got rows of {row.shape[0]}"
            )
        return row[torch.tensor(kept, device=row.device)]  # (h',)

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None,
        head_mask: Tensor | None = None,
        depths: int | None = None,
        weights_from: int | None = None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """x (B, T', D) embedded, head_mask (L, h) -> (hidden states [x, ...] (B, T', D) of the
        first `depths` layers (None: all L), weights (B, h, T', T') of the depths >=
        `weights_from` (1-based; None: none)). Padded positions are zero in every hidden state,
        so a padded batch gives what each utterance gives alone. The depths returning weights
        run their dense reference: their hidden states match the plain call's to rounding."""
        if head_mask is not None and (
            head_mask.shape[0] != self.num_layers
            or (
                self.residual_head_mask is not None
                and head_mask.shape != self.residual_head_mask.shape
            )
        ):
            raise ValueError(
                f"head_mask must be (L={self.num_layers}, h), got {tuple(head_mask.shape)}"
            )
        keep = None if padding_mask is None else (~padding_mask)[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        hidden, weights = [x], []
        for depth, index in enumerate(self.depth_to_layer[:depths]):
            need = weights_from is not None and depth + 1 >= weights_from
            hm = self._depth_head_mask(head_mask, depth)
            out = self.layers[index](x, padding_mask, hm, need_weights=need)
            if need:
                x, w = out
                weights.append(w)
            else:
                x = out
            if depth == self.num_layers - 1:
                x = self.final_norm(x)
            if keep is not None:
                x = x * keep  # LayerNorm biases would otherwise leak into padded positions
            hidden.append(x)
        return hidden, weights


def padding_mask_for(lengths: Tensor, x: Tensor) -> Tensor | None:
    """(B, T') True at padded frames of x (B, T', ...) for valid lengths (B,); None when no
    frame is padded (every layer then takes its unmasked kernel). Only host-side lengths are
    read: lengths on x's GPU always give a mask, built there without a sync."""
    T = x.shape[1]
    if lengths.device.type == "cpu" and min(lengths.tolist(), default=T) >= T:
        return None
    return lengths_to_padding_mask(lengths.to(x.device, non_blocking=True), T)


class ReconstructionHead(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear back to the stacked feature dim (Mockingjay)."""

    def __init__(self, dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.out = nn.Linear(dim, out_dim)

    def forward(self, h: Tensor) -> Tensor:
        """h (B, T', D) -> (B, T', stack*F)."""
        return self.out(self.norm(F_.gelu(self.dense(h))))


@dataclass
class ModelConfig:
    """Everything needed to rebuild the network; saved verbatim in `upstream.pt`."""

    feature_dim: int = 80  # F: log-mel bins per 10 ms frame (the data layer's feature_dim)
    stack: int = 3  # 10 ms frames per model step: 30 ms steps, a third of the sequence length
    dim: int = 768  # D, "hidden_size" in AALBERT
    num_layers: int = 6  # L applications of the layer, "num_hidden_layers"
    num_heads: int = 12  # h, "num_attention_heads"
    ffn_dim: int = 3072  # "intermediate_size"
    shared: bool = True  # ALBERT cross-layer sharing: one layer object applied L times
    pre_norm: bool = False  # BERT post-LN is what AALBERT used; pre-LN is the stabler option
    dropout: float = 0.1  # "hidden_dropout_prob"
    layer_norm_eps: float = 1e-12  # BERT/AALBERT value
    position_scale: float = 1.0  # weight of the sinusoidal positions against the content
    conv_position_kernel: int = 0  # odd width of the convolutional positions; 0: none (AALBERT)
    conv_position_groups: int = 16  # groups of that convolution (dim must be divisible by it)
    attention: str = "full"  # a name from speechattn.attention.available()
    attention_options: dict[str, Any] = field(default_factory=dict)  # passed to attention.build
    # `AALBERT.prune_heads`: layer (0 when shared) -> original indices of the heads it keeps
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)
    # (L, h) xi under every run-time head mask: a pruned shared layer's heads masked at some
    # depths only (None: nothing left to mask)
    residual_head_mask: list[list[float]] | None = None

    def __post_init__(self) -> None:
        for name in ("feature_dim", "stack", "dim", "num_layers", "num_heads", "ffn_dim"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, f"model.net.{name}", value, "an integer >= 1")
        kernel, groups = self.conv_position_kernel, self.conv_position_groups
        divides_dim = f"a divisor of model.net.dim={self.dim}"
        eps = self.layer_norm_eps
        for name, ok, rule in (
            ("num_heads", self.dim % self.num_heads == 0, divides_dim),
            ("dropout", is_number(self.dropout) and 0 <= self.dropout < 1, "in [0, 1)"),
            ("layer_norm_eps", is_number(eps) and eps > 0, "> 0"),
            ("position_scale", is_number(self.position_scale), "a number"),
            (
                "conv_position_kernel",
                is_int(kernel) and (kernel == 0 or (kernel > 0 and kernel % 2 == 1)),
                "0 (none) or an odd width >= 1",
            ),
            (  # the groups split the convolution's channels; unused without it
                "conv_position_groups",
                not kernel or (is_int(groups) and groups >= 1 and self.dim % groups == 0),
                divides_dim,
            ),
        ):
            require(ok, f"model.net.{name}", getattr(self, name), rule)
        self.attention_options = dict(self.attention_options)
        # keys may come back as strings from JSON (heads.json, model cards)
        self.pruned_heads = {int(j): sorted(map(int, k)) for j, k in self.pruned_heads.items()}
        layers = 1 if self.shared else self.num_layers
        for j, kept in self.pruned_heads.items():
            if not 0 <= j < layers or not kept or not 0 <= kept[0] <= kept[-1] < self.num_heads:
                raise ConfigError(
                    f"pruned_heads[{j}] = {kept}: expected a layer in [0, {layers}) keeping "
                    f"heads in [0, {self.num_heads})"
                )
        if self.residual_head_mask is not None:
            self.residual_head_mask = [list(map(float, row)) for row in self.residual_head_mask]
            shape = (len(self.residual_head_mask), *{len(r) for r in self.residual_head_mask})
            if shape != (self.num_layers, self.num_heads):
                raise ConfigError(
                    f"residual_head_mask must be (L, h) = ({self.num_layers}, {self.num_heads})"
                )

    @property
    def input_dim(self) -> int:
        """Stacked feature dim the model reads and reconstructs (3F = 240 for 80 mel bins)."""
        return self.stack * self.feature_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


AttentionFactory = Callable[[int], nn.Module]  # layer index -> attention module


def registry_attention(config: ModelConfig) -> AttentionFactory:
    """A factory building `config.attention` from the registry with the model's dim and heads,
    for the layer at the given index (0 for the shared layer)."""
    from speechattn.attention import build

    c = config
    return lambda layer: build(c.attention, c.dim, c.num_heads, layer=layer, **c.attention_options)


class AALBERT(nn.Module):
    """Input embedding -> (shared) encoder -> reconstruction head; pretraining calls the pieces
    (`stack`, `reconstruct`), masking stacked frames in between."""

    def __init__(self, config: ModelConfig, make_attention: AttentionFactory | None = None) -> None:
        super().__init__()
        self.config = c = config
        make_attention = make_attention or registry_attention(config)
        self.embedding = InputEmbedding(c)
        layers = [
            EncoderLayer(make_attention(i), c) for i in range(1 if c.shared else c.num_layers)
        ]
        final_norm = nn.LayerNorm(c.dim, eps=c.layer_norm_eps) if c.pre_norm else nn.Identity()
        self.encoder = Encoder(layers, c.num_layers, final_norm)
        self.head = ReconstructionHead(c.dim, c.input_dim, c.layer_norm_eps)
        self._init_own_weights()
        for j, kept in c.pruned_heads.items():  # rebuild a pruned model's structure
            prune_heads(self.encoder.layers[j].attention, kept)
        self._set_residual(c.residual_head_mask)

    def _init_own_weights(self) -> None:
        """BERT init (normal, std 0.02) for our Linear layers; attention modules keep theirs
        (e.g. `syn_fixed`'s logits from patterns)."""
        attention_params = {
            id(p) for layer in self.encoder.layers for p in layer.attention.parameters()
        }
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in attention_params:
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # std 1/sqrt(3F) keeps unit-variance features at the sinusoids' scale: with 0.02 the
        # positions dominate after the LayerNorm, and short runs lose to raw log-mel in probes.
        nn.init.normal_(self.embedding.proj.weight, std=self.config.input_dim**-0.5)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def max_input_frames(self) -> int | None:
        """Longest input in 10 ms frames: the attention's max_len x stack (None: no limit)."""
        limits = [m.max_len for m in self.modules() if isinstance(m, Attention) and m.max_len]
        return min(limits) * self.config.stack if limits else None

    def check_input_frames(self, frames: int, setting: str, uncropped: bool = False) -> None:
        """`ConfigError` (a ValueError), before any batch runs, when `frames` 10 ms frames (the
        value of `setting`, or with `uncropped` the longest utterance it lets through) exceed
        what the attention accepts."""
        limit = self.max_input_frames
        if limit is None or frames <= limit:
            return
        stack = self.config.stack
        given = f"{setting}={frames}"
        if uncropped:
            given = f"{setting}=null lets a {frames}-frame utterance through"
        raise ConfigError(
            f"{given}, more than attention={self.config.attention} accepts: "
            f"{limit} input frames (max_len {limit // stack} model frames x {stack}); set "
            f"{setting}<={limit} or, when pretraining, attention.options.max_len>="
            f"{-(-frames // stack)}"
        )

    def prune_heads(self, heads: Mapping[int, Sequence[int]] | Tensor) -> None:
        """Remove attention heads' parameters (actual pruning), recorded in the config.

        heads: {layer (index into `encoder.layers`): original indices of the heads to keep},
        or an (L, h) head mask xi (0 = masked), whose pruned model equals this model run with
        it (rules: docs/analysis.md, Actual pruning); non-binary xi of kept heads go into
        `config.residual_head_mask`.
        """
        layers, h = len(self.encoder.layers), self.num_heads
        if not isinstance(heads, Tensor):
            bad = {j: k for j, k in heads.items() if not 0 <= j < layers or not k}
            bad.update({j: k for j, k in heads.items() if any(not 0 <= i < h for i in k)})
            if bad:
                raise ValueError(
                    f"prune_heads: expected {{layer in [0, {layers}): heads to keep in [0, {h}), "
                    f"at least one}}, got {bad}"
                )
        elif heads.shape != (self.num_layers, h):
            raise ValueError(f"prune_heads: expected a head mask (L, h) = {(self.num_layers, h)}")
        else:
            heads, residual = pruning_plan(heads, self.encoder.depth_to_layer)
            earlier = self.encoder.residual_head_mask
            if earlier is not None:
                residual = earlier if residual is None else residual * earlier.to(residual)
            self._set_residual(None if residual is None else residual.tolist())
        for j, kept in heads.items():
            attention = self.encoder.layers[j].attention
            current = list(attention.kept_heads)
            # removed heads stay removed; with none left the first stays, residual-masked
            local = [current.index(k) for k in kept if k in current] or [0]
            prune_heads(attention, local)
            if attention.num_heads < self.num_heads:
                self.config.pruned_heads[j] = list(attention.kept_heads)

    def _set_residual(self, residual: list[list[float]] | None) -> None:
        self.config.residual_head_mask = residual
        like = next(self.parameters())
        mask = None if residual is None else torch.tensor(residual, device=like.device).to(like)
        self.encoder.residual_head_mask = mask

    def get_num_params(self, include_head: bool = True) -> int:
        """Unique parameters (a shared layer counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if not include_head:
            n -= sum(p.numel() for p in self.head.parameters())
        return n

    def stack(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """features (B, T, F) 10 ms, lengths (B,) -> (B, T', stack*F), lengths' (B,)."""
        if features.shape[-1] != self.config.feature_dim:
            raise ValueError(
                f"expected features (B, T, F={self.config.feature_dim}), got {tuple(features.shape)}"
            )
        return stack_frames(features, lengths, self.config.stack)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """10 ms frame counts -> model frame counts: ceil(T / stack)."""
        return torch.div(lengths + self.config.stack - 1, self.config.stack, rounding_mode="floor")

    def embed_and_encode(
        self, stacked: Tensor, lengths: Tensor, head_mask: Tensor | None = None
    ) -> list[Tensor]:
        """stacked (B, T', stack*F), lengths' (B,) (best on the host: `padding_mask_for`) -> L+1
        hidden states (B, T', D)."""
        return self.encode(stacked, padding_mask_for(lengths, stacked), head_mask)

    def encode(
        self, stacked: Tensor, padding_mask: Tensor | None, head_mask: Tensor | None = None
    ) -> list[Tensor]:
        """`embed_and_encode` given the padding mask (B, T') (None: nothing padded), the form
        `torch.compile` takes."""
        return self.encode_with_weights(stacked, padding_mask, head_mask, weights_from=None)[0]

    def encode_with_weights(
        self,
        stacked: Tensor,
        padding_mask: Tensor | None,
        head_mask: Tensor | None = None,
        depths: int | None = None,
        weights_from: int | None = 1,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """`encode` of the first `depths` layers, also returning weights (`Encoder.forward`)."""
        x = self.embedding(stacked, padding_mask)  # (B, T', D)
        return self.encoder(x, padding_mask, head_mask, depths, weights_from)

    def reconstruct(
        self, stacked: Tensor, lengths: Tensor, head_mask: Tensor | None = None
    ) -> Tensor:
        """Masked-reconstruction prediction (`masking.reconstruction_loss`): stacked (B, T',
        stack*F) corrupted, lengths' (B,) -> (B, T', stack*F)."""
        return self.head(self.embed_and_encode(stacked, lengths, head_mask)[-1])

    def forward(
        self, features: Tensor, lengths: Tensor, head_mask: Tensor | None = None
    ) -> list[Tensor]:
        """features (B, T, F) normalised log-mel, lengths (B,) -> L+1 hidden states (B, T', D)."""
        stacked, out_lengths = self.stack(features, lengths)
        return self.embed_and_encode(stacked, out_lengths, head_mask)

    def attention_weights(
        self, features: Tensor, lengths: Tensor, layer: int, head_mask: Tensor | None = None
    ) -> Tensor:
        """Weights (B, h, T', T') of the attention at depth `layer` (1..L, like hidden[layer]),
        the depths below it on their efficient path."""
        if not 1 <= layer <= self.num_layers:
            raise ValueError(f"layer must be in 1..{self.num_layers}, got {layer}")
        stacked, out_lengths = self.stack(features, lengths)
        padding_mask = padding_mask_for(out_lengths, stacked)
        return self.encode_with_weights(stacked, padding_mask, head_mask, layer, layer)[1][-1]


def pruning_plan(
    head_mask: Tensor, depth_to_layer: Sequence[int]
) -> tuple[dict[int, list[int]], Tensor | None]:
    """Heads to keep per layer for an (L, h) head mask (`AALBERT.prune_heads`), and the residual
    (L, h) float head mask (None when every kept head has xi = 1 at every depth)."""
    L, h = head_mask.shape
    if L != len(depth_to_layer):
        raise ValueError(f"head mask must be (L={len(depth_to_layer)}, h), got {(L, h)}")
    on = head_mask.detach().cpu().double() != 0  # (L, h)
    keep: dict[int, list[int]] = {}
    for j in sorted(set(depth_to_layer)):
        depths = [d for d, layer in enumerate(depth_to_layer) if layer == j]
        keep[j] = on[depths].any(0).nonzero().flatten().tolist() or [0]
    residual = head_mask.detach().cpu().double().clone()
    needed = any(bool((residual[d, keep[j]] != 1).any()) for d, j in enumerate(depth_to_layer))
    return keep, residual if needed else None


def aalbert(make_attention: AttentionFactory | None = None, **config: Any) -> AALBERT:
    """`AALBERT(ModelConfig(**config), make_attention)`, e.g. `aalbert(attention="ldsa")`;
    `make_attention` (layer index -> a fresh attention module) overrides the registry."""
    return AALBERT(ModelConfig(**config), make_attention)


# What each preset changes of `ModelConfig` (the study's AALBERT): the one source for Python
# and the command line (`speechattn.config` registers its schema from it; conf/experiment/tiny.yaml
# says why the CPU quick start differs).
PRESETS: dict[str, dict[str, Any]] = {
    "aalbert_base": {},
    "aalbert_tiny": {
        "dim": 256,
        "num_layers": 3,  # the last of 4 lost phone information to reconstruction
        "num_heads": 8,
        "ffn_dim": 1024,
        "pre_norm": True,
        "dropout": 0.0,
        "position_scale": 0.0,  # no sinusoids ...
        "conv_position_kernel": 15,  # ... but convolutional positions over 450 ms
    },
}


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a preset (`PRESETS`), with `overrides`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def aalbert_base(**overrides: Any) -> AALBERT:
    """The study's model (`model=aalbert_base`, the `ModelConfig` defaults): 6 shared post-LN
    layers, D 768, 12 heads, FFN 3072, sinusoidal positions, as AALBERT."""
    return AALBERT(preset_config("aalbert_base", **overrides))


def aalbert_tiny(**overrides: Any) -> AALBERT:
    """The CPU default (`experiment=tiny`): 3 shared pre-LN layers, D 256, 8 heads,
    convolutional positions; pretrains in minutes on two cores."""
    return AALBERT(preset_config("aalbert_tiny", **overrides))
