"""Helpers for the attention tests: small, fast configurations and padded batches."""

from __future__ import annotations

import pytest
import torch

from speechattn.attention import Attention, available, build, get

DIM, HEADS = 32, 4

# Options that make each variant non-trivial at T ~ 20 (a new variant works with {}).
SMALL_OPTIONS: dict[str, dict] = {
    "syn_dense": {"max_len": 64},
    "syn_dense_mh": {"max_len": 64},
    "syn_random": {"max_len": 64},
    "syn_fixed": {"max_len": 64},
    "ldsa": {"context": 5},
    "longformer": {"window": 2, "dilation": 3, "global_every": 7},
    "adaptive_span": {"max_span": 8, "ramp": 2},  # spans of 2 frames, reach 3: the band kernel
    "routing": {"window": 2, "max_clusters": 3},  # clusters of ~T/3 frames
    **{
        n: {"k": 5, "bits": 8}
        for n in ("sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh")
    },
}


def make(name: str, torch_seed: int = 0, **options) -> Attention:
    """A float64 module in eval mode with deterministic weights."""
    torch.manual_seed(torch_seed)
    return build(name, DIM, HEADS, **{**SMALL_OPTIONS.get(name, {}), **options}).double().eval()


def batch(
    lengths: list[int], T: int | None = None, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, DIM) float64 and padding_mask (B, T), True past each length."""
    T = T or max(lengths)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), T, DIM, generator=g, dtype=torch.float64)
    pad = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
    return x, pad


def force_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make every two-kernel variant (`short_path_max_t` set) use its short (all pairs) or
    its long kernel at any T, so tiny test inputs reach both."""
    for name in available():
        cls = get(name)
        if cls.short_path_max_t is not None:
            monkeypatch.setattr(cls, "short_path_max_t", 10**9 if path == "short" else 0)


def kernels() -> list[tuple[str, str]]:
    """(variant, "short" | "long") for every kernel of every registered variant."""
    names = available()
    return [(n, "short") for n in names] + [
        (n, "long") for n in names if get(n).short_path_max_t is not None
    ]


def device_kernels() -> list[tuple[str, str]]:
    """`kernels()` plus every other named kernel (`kernel_names`): sparse_*'s "blocked",
    "masked" and "flex" (Flex trains on CUDA only: torch 2.11 has no Flex backward on CPU),
    routing's "masked" local heads. Run them with `use_kernel`."""
    cases = kernels()
    for n in available():
        names = build(n, DIM, HEADS, **SMALL_OPTIONS.get(n, {})).kernel_names
        cases += [(n, k) for k in names if k not in ("short", "long", "one")]
    return cases


def use_kernel(attn: Attention, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `attn` run `kernel` (a name of `device_kernels`) at any T."""
    if kernel in ("short", "long"):
        force_path(monkeypatch, kernel)
    else:
        monkeypatch.setattr(attn, "_forced_kernel", kernel)


def kernels_and_reference(
    build_attn, x, pad, weight: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(y, dL/dx, dL/d`weight`) of L = sum(y * w) through a two-kernel variant's short kernel,
    its long kernel and its dense reference, each on a fresh module from `build_attn()`."""
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    results = []
    for limit in (10**9, 0, None):  # short kernel, long kernel, dense reference
        attn = build_attn()
        xi = x.clone().requires_grad_(True)
        if limit is None:
            y = attn.dense_reference(xi, pad)[0]
        else:
            monkeypatch.setattr(type(attn), "short_path_max_t", limit)
            y = attn(xi, pad)
        (y * w).sum().backward()
        results.append((y.detach(), xi.grad, attn.get_parameter(weight).grad))
    return results


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against the reference b, in float32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# Stated tolerances of half-precision autocast against float32 (see test_precision.py).
OUTPUT_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
GRAD_TOLERANCE = {torch.bfloat16: 8e-2, torch.float16: 3e-3}


def train_pass(attn: Attention, x, pad, w, dtype: torch.dtype | None = None, dense: bool = False):
    """One forward + backward of sum(y * w), under autocast to `dtype` (None: none), through
    the efficient path or the dense reference. Returns (y, dL/dx, {parameter: gradient})."""
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = attn.dense_reference(xi, pad)[0] if dense else attn(xi, pad)
    (y.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad, grads


def hold_selection(attn: Attention, monkeypatch: pytest.MonkeyPatch) -> None:
    """Variants that select keys (LSH, routing): the first selection `select` computes serves
    every later call and the dense reference's selection, so passes in other dtypes differ in
    their kernels only (a sign bit or a cluster of a half-precision query may flip, which
    changes the keys, not the kernels' accuracy). Routing's long kernel takes its clusters
    from `members`, which `select` reads too: the first one computed is held as well."""
    if not hasattr(attn, "select"):
        return
    chosen = {}
    select = attn.select
    if hasattr(attn, "members"):
        members = attn.members

        def held_members(k, valid):
            return chosen.setdefault("members", members(k, valid))

        monkeypatch.setattr(attn, "members", held_members)

    def held(q, k, valid):
        return chosen.setdefault("idx", select(q, k, valid))

    def held_dense(q, k, valid):
        T = q.shape[-2]
        mask = torch.zeros(q.shape[:-1] + (T,), dtype=torch.bool, device=q.device)
        return mask.scatter(-1, held(q, k, valid), True)

    monkeypatch.setattr(attn, "select", held)
    monkeypatch.setattr(attn, "selection_dense", held_dense)
