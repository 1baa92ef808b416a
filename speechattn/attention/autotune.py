"""Kernel choice by measurement on the machine that runs it (design: docs/gpu.md, "Kernels
chosen by measurement").

Variants with several exact kernels ask `pick_kernel(module, t)`: the rule by default; with
`enable(model)` the first call per key times every candidate (interleaved, eval mode, RNG
states forked) unless `rule_only`. Cache: per module, per process and
`$SPEECHATTN_CACHE/autotune/kernels.json` (atomic, merged). DDP ranks may choose differently:
every kernel computes the same function.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.attention.base import Attention, compute_dtype
from speechattn.errors import is_int, is_number
from speechattn.utils import (
    atomic_write_text,
    crop_lengths,
    default_cache_root,
    digest,
    lengths_to_padding_mask,
)

CACHE_VERSION = 3  # 2: timed on padded batches; 3: LSH kernels compiled on the CPU
REPS = 3  # timed steps per kernel after one warm-up each; the min counts
MIN_SECONDS = 0.05  # ... and more (up to MAX_REPS) until each ran this long (short steps are noisy)
MAX_REPS = 20
MARGIN = 0.03  # the rule's kernel stays unless the other is this much faster (noise)
MIN_BUCKET = 32
SCORE_BUDGET = 256 * 2**20  # bytes of one timed (B', h, T, T) score tensor; above: the rule
# Config fields that do not change which kernel is faster (timing runs in eval mode).
IGNORED_OPTIONS = ("dim", "num_heads", "layer", "dropout")


def pick_kernel(module: Attention, t: Tensor) -> str:
    """The kernel `module` runs for t, x (B, T, D) or q (B, h, T, d_k): the rule, or with
    `enable` (never while compiling) the fastest for T's bucket."""
    if module._forced_kernel is not None:  # the tuner is timing one kernel
        return module._forced_kernel
    T = t.shape[-2] if t.dim() == 4 else t.shape[1]
    if module.autotune and not torch.compiler.is_compiling() and module.kernel_candidates(t):
        return choose(module, t, T)
    return module.rule_kernel(T, t.device)


def use_short_path(module: Attention, t: Tensor) -> bool:
    return pick_kernel(module, t) == "short"


def enable(model: nn.Module, on: bool = True) -> int:
    """Switch measurement on (or off) for every attention module of `model`; returns how many
    have several kernels."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            m.autotune = on
            n += len(m.kernel_names) > 1
    return n


def rule_only(t: Tensor) -> bool:
    """Whether t's context rules measurement out: compiling, tracing, fake, meta or subclassed
    tensors, a dispatch mode, CUDA without a driver."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        or type(t) not in (Tensor, nn.Parameter)
        or is_fake(t)
        or t.device.type == "meta"
        or _get_current_dispatch_mode() is not None
        or (t.device.type == "cuda" and not torch.cuda.is_available())
    )


def bucket(T: int) -> int:
    """The smallest of 32, 48, 64, 96, ..., 2^k, 1.5 x 2^k that is >= T."""
    if T <= MIN_BUCKET:
        return MIN_BUCKET
    p = 1 << (T - 1).bit_length()
    return p * 3 // 4 if T <= p * 3 // 4 else p


@functools.cache
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    """What the timings belong to, e.g. "cpu:AMD EPYC, 2 threads" (threads move CPU
    crossovers as much as the model does)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu:{_cpu_model()}, {torch.get_num_threads()} threads"
    return device.type


def timed_shape(module: Attention, t: Tensor, T: int) -> tuple[int, int, tuple[str, ...]] | None:
    """(B', T_b, kernels) to time for t at T frames: the candidates, less the all-pairs ones
    when one sequence's scores exceed `SCORE_BUDGET`; None when fewer than two are left."""
    B = t.shape[0]
    T_b = min(bucket(T), module.max_len or bucket(T))
    per_sequence = module.num_heads * T_b * T_b * compute_dtype(t).itemsize
    fits = SCORE_BUDGET // per_sequence
    kernels = module.kernel_candidates(t)
    if fits < 1:
        kernels = tuple(k for k in kernels if k not in module.all_pairs_kernels)
    if len(kernels) < 2:
        return None
    if any(k in module.all_pairs_kernels for k in kernels):
        B = min(B, fits)
    B_t = max(1, B)
    return 1 << (B_t.bit_length() - 1), T_b, kernels  # a power of two <= B'


def choose(module: Attention, t: Tensor, T: int) -> str:
    """The kernel for t at T frames: measured once per key, then from memory or disk."""
    if rule_only(t):
        return module.rule_kernel(T, t.device)
    shape = timed_shape(module, t, T)
    memo_key = (bucket(T), shape, t.device, compute_dtype(t), module.num_heads)
    memo = module._kernel_memo
    if memo_key in memo:
        return memo[memo_key]
    if shape is None:
        entry = {"kernel": module.rule_kernel(T, t.device), "by": "rule (scores over budget)"}
        label = f"{module.name} T<={bucket(T)} {compute_dtype(t)}"
    else:
        B_t, T_b, kernels = shape
        parts = {  # everything the measured choice depends on
            "device": device_name(t.device),
            "torch": torch.__version__,
            "dtype": str(compute_dtype(t)).removeprefix("torch."),
            "variant": module.name,
            "heads": module.num_heads,
            "head_dim": module.head_dim,
            "options": {k: v for k, v in asdict(module.config).items() if k not in IGNORED_OPTIONS},
            "kernels": list(kernels),
            "bucket": bucket(T),
            "batch": B_t,
        }
        key, path = digest(parts), cache_path()
        entry = _entries(path).get(key)
        if entry is not None and entry["kernel"] in kernels:  # else renamed since: measure
            entry = {**entry, "by": "cache"}
        else:
            ms, failed = measure(module, t, B_t, T_b, kernels)
            entry = {
                **parts,
                "kernel": pick(ms, module.rule_kernel(T_b, t.device)),
                "ms": {k: round(v, 4) for k, v in ms.items()},
                "measured_at": T_b,
                **({"failed": failed} if failed else {}),
            }
            _store(path, key, entry)
            entry = {**entry, "by": "measured"}
        label = f"{module.name} T<={bucket(T)} {parts['dtype']} B'={B_t} {parts['device']}"
    kernel = entry["kernel"]
    memo[memo_key] = kernel
    module.kernel_choices[label] = {
        "bucket": bucket(T),
        "kernel": kernel,
        "by": entry["by"],
        **({"ms": entry["ms"]} if "ms" in entry else {}),
    }
    return kernel


def pick(ms: dict[str, float], ruled: str) -> str:
    """The fastest kernel of `ms` (milliseconds by kernel), or the rule's unless the fastest
    is `MARGIN` faster (noise must not flip a choice)."""
    best = min(ms, key=ms.__getitem__)
    if ruled in ms and ms[best] >= (1 - MARGIN) * ms[ruled]:
        return ruled
    return best


def time_once(step: Callable[[], None], kernel: str, device: torch.device) -> float:
    """Seconds of one `step` (the forward + backward of `kernel`); tests replace it."""
    del kernel
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(
    module: Attention, like: Tensor, B: int, T: int, kernels: tuple[str, ...]
) -> tuple[dict[str, float], dict[str, str]]:
    """Milliseconds of forward + backward of each of `kernels` on random x (B, T, D), min
    over interleaved steps after a warm-up; and {kernel: error} for those that raised."""
    device = like.device
    dtype = module.out_proj.weight.dtype  # the module's input dtype (autocast casts inside)
    gen = torch.Generator().manual_seed(T)
    forks = [device] if device.type == "cuda" else []
    best = {k: math.inf for k in kernels}
    spent = {k: 0.0 for k in kernels}
    failed: dict[str, str] = {}
    with (
        torch.random.fork_rng(forks, device_type="cuda"),
        _eval(module),
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        x = torch.randn(B, T, module.dim, generator=gen).to(device, dtype).requires_grad_()
        inputs = [x, *(p for p in module.parameters() if p.requires_grad)]
        # padded as training's batches are (they always are): the masked paths are timed
        lengths = crop_lengths(B, T, gen)
        valid = (~lengths_to_padding_mask(lengths, T)).to(device)  # (B, T)

        def step() -> None:
            out = module.attend(x, valid)  # (B, h, T, d_k)
            torch.autograd.grad(out.float().sum(), inputs, allow_unused=True)

        for rep in range(MAX_REPS + 1):
            for kernel in kernels:
                if kernel in failed:
                    continue
                try:
                    with forced(module, kernel):
                        seconds = time_once(step, kernel, device)
                except Exception as err:  # noqa: BLE001 - any failure rules the kernel out
                    failed[kernel] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    warnings.warn(
                        f"{module.name}: the {kernel} kernel failed while timed, left out "
                        f"({failed[kernel]})",
                        stacklevel=2,
                    )
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if rep:  # rep 0 warms up
                    best[kernel] = min(best[kernel], seconds)
                    spent[kernel] += seconds
            timed = [k for k in kernels if k not in failed]
            if not timed or (rep >= REPS and min(spent[k] for k in timed) >= MIN_SECONDS):
                break
    if len(failed) == len(kernels):
        raise RuntimeError(f"{module.name}: every kernel failed while timed: {failed}")
    return {k: 1000 * v for k, v in best.items() if k not in failed}, failed


@contextlib.contextmanager
def forced(module: Attention, kernel: str | None) -> Iterator[None]:
    """Make `pick_kernel(module, ...)` answer `kernel` (None: as usual) in the block."""
    previous, module._forced_kernel = module._forced_kernel, kernel
    try:
        yield
    finally:
        module._forced_kernel = previous


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, no centroid updates) for the block, then each module's own."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def cache_path() -> Path:
    return default_cache_root() / "autotune" / "kernels.json"


def _read(path: Path, warn: bool = True) -> dict[str, dict[str, Any]]:
    """The file's entries; {} when it is missing or corrupt (with a warning)."""
    try:
        data = json.loads(path.read_text())
        problem = f"the kernel cache {path} (unexpected content)"
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        data, problem = None, f"the corrupt kernel cache {path} ({err})"
    entries = data.get("entries") if isinstance(data, dict) else None
    if not (isinstance(entries, dict) and data.get("version") == CACHE_VERSION):
        if warn:
            warnings.warn(f"ignoring {problem}; it will be rewritten", stacklevel=2)
        return {}
    good = {key: e for key, e in entries.items() if _valid_entry(e)}
    if len(good) < len(entries) and warn:
        warnings.warn(
            f"ignoring {len(entries) - len(good)} malformed entries of the kernel cache {path} "
            f"(kept {len(good)}); they will be measured again",
            stacklevel=2,
        )
    return good


def _valid_entry(entry: object) -> bool:
    """An entry as `choose` writes it; others are dropped alone, so nothing malformed reaches a
    model card or upstream.pt."""
    if not isinstance(entry, dict) or not isinstance(entry.get("kernel"), str):
        return False
    ms = entry.get("ms", {})
    if not isinstance(ms, dict) or not all(
        isinstance(k, str) and is_number(v) and 0 <= v < float("inf") for k, v in ms.items()
    ):
        return False
    return is_int(entry.get("measured_at", 0)) and isinstance(entry.get("failed", {}), dict)


@functools.cache
def _entries(path: Path) -> dict[str, dict[str, Any]]:
    """The cache file's entries, read once per process (`clear_memory`)."""
    return _read(path)


def _store(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add `entry` in memory and on disk, merged with the file as it is now (other processes)."""
    entries = _entries(path)
    entries[key] = entry
    merged = {**_read(path, warn=False), **entries}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": CACHE_VERSION, "entries": merged}, indent=1, sort_keys=True)
        atomic_write_text(path, text + "\n")
    except OSError as err:  # a read-only cache: keep the choice in memory only
        warnings.warn(f"could not write the kernel cache {path}: {err}", stacklevel=2)


def clear_memory() -> None:
    """Forget the files read in this process (tests; the disk and module memos stay)."""
    _entries.cache_clear()


def choices(model: nn.Module) -> dict[str, Any]:
    """The kernel choices so far, for run metadata and model cards: {"autotune",
    "short_path_max_t", "choices": {"VARIANT T<=T_b DTYPE ...": {"bucket", "kernel", "by", "ms"}}}."""
    modules = [m for m in model.modules() if isinstance(m, Attention)]
    if not modules:
        return {}
    first = modules[0]
    made: dict[str, Any] = {}
    for m in modules:  # unshared layers share keys: the first layer measured, the rest read
        for label, choice in m.kernel_choices.items():
            made.setdefault(label, choice)
    return {
        "autotune": any(m.autotune for m in modules),
        "short_path_max_t": first.short_path_max_t,
        "choices": dict(sorted(made.items(), key=lambda kv: (kv[1]["bucket"], kv[0]))),
    }


def used(module: Attention, T: int) -> str:
    """The kernel `module` takes at T frames now, for tables: "one" (a single kernel), else
    its name, with "*" when measured (or read from the cache)."""
    if len(module.kernel_names) < 2:
        return "one"
    prefix = f"{module.name} T<={bucket(T)} "
    for label, c in module.kernel_choices.items():
        if label.startswith(prefix):
            return c["kernel"] + ("*" if c["by"] in ("measured", "cache") else "")
    return module.rule_kernel(T, module.out_proj.weight.device)
