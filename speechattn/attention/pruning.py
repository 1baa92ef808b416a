"""Head pruning of an attention module in place: `prune_heads(module, keep)` (D stays; the
heads' inner size becomes h' d_k)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from speechattn.attention.base import Attention


def prune_heads(module: Attention, keep: Sequence[int]) -> None:
    """Remove every head of `module` not in `keep` (current indices): kept heads stay in order
    (so heads with a role by position remain a prefix and a suffix), outputs are exactly those
    with xi = 0 on the removed heads, and `kept_heads` maps them to the original ones."""
    kept = sorted(set(int(k) for k in keep))
    if len(kept) != len(keep) or not kept or kept[0] < 0 or kept[-1] >= module.num_heads:
        raise ValueError(
            f"{module.name}: keep must list distinct head indices in [0, {module.num_heads}) "
            f"and at least one, got {list(keep)}"
        )
    if len(kept) == module.num_heads:
        return
    if not (module.head_projections or module.head_tensors):
        raise NotImplementedError(f"attention {module.name!r} does not implement prune_heads")
    index = torch.tensor(kept, dtype=torch.long)
    module._remove_heads(index)  # the variant's own per-head state, h still the old one
    for name, blocks in module.head_projections.items():
        remove_projection_heads(module, getattr(module, name), index, blocks)
    for name in module.head_tensors:
        if getattr(module, name) is not None:
            select_(module, name, index)
    select_linear_(module.out_proj, head_index(index, module.head_dim, module.num_heads), dim=1)
    module.kept_heads = [module.kept_heads[k] for k in kept]
    module.num_heads = len(kept)


def remove_projection_heads(
    module: Attention, linear: nn.Linear, index: Tensor, blocks: int = 1, size: int | None = None
) -> None:
    """Keep heads `index` (sorted, long) of `module`'s projection `linear`, whose outputs are
    `blocks` x h x `size` (default d_k), e.g. blocks = 3 for a fused W^Q | W^K | W^V."""
    rows = head_index(index, size or module.head_dim, module.num_heads, blocks)
    select_linear_(linear, rows, dim=0)


def head_index(keep: Tensor, size: int, num_heads: int, blocks: int = 1) -> Tensor:
    """Positions of heads `keep` along an axis of `blocks` x h x `size` entries (e.g. the rows
    of a fused W^Q | W^K | W^V, blocks = 3, size = d_k): (blocks h' size,) long."""
    per_head = (keep[:, None] * size + torch.arange(size)).reshape(-1)  # (h' size,)
    return torch.cat([b * num_heads * size + per_head for b in range(blocks)])


def select_(module: nn.Module, name: str, index: Tensor, dim: int = 0) -> None:
    """Replace parameter or buffer `name` of `module` by its entries `index` along `dim`."""
    old = getattr(module, name)
    new = old.detach().index_select(dim, index.to(old.device))
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))
    else:
        module._buffers[name] = new


def select_linear_(linear: nn.Linear, index: Tensor, dim: int) -> None:
    """Keep outputs (dim = 0) or inputs (dim = 1) `index` of a Linear layer."""
    select_(linear, "weight", index, dim)
    if dim == 0:
        if linear.bias is not None:
            select_(linear, "bias", index)
        linear.out_features = len(index)
    else:
        linear.in_features = len(index)
