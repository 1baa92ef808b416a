"""Pieces shared by the benchmarks: their command-line plumbing, device sync and timing, the
measured matmul peak, precision contexts, memory probes, the chosen variants, JSON output."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speechattn.attention import available
from speechattn.attention.registry import options as attention_options
from speechattn.errors import UsageExit

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
Clock = Callable[[], float]  # seconds: time.perf_counter or time.process_time


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of `python -m speechattn.bench NAME`, described by `doc`'s first line."""
    return argparse.ArgumentParser(
        prog=f"python -m speechattn.bench {name}", description=doc.split("\n")[0]
    )


def add_run_arguments(
    p: argparse.ArgumentParser, devices: Sequence[str] | None = None, clock: bool = True
) -> None:
    """How a timed benchmark runs (`finish_run_arguments` applies them once parsed)."""
    p.add_argument("--device", default="cpu", choices=devices)
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default=None,
        help="autocast dtype (default: bf16 on cuda, fp32 on cpu)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    if clock:
        p.add_argument(
            "--clock",
            default="wall",
            choices=("wall", "cpu"),
            help="cpu: process CPU time, immune to other load with --threads 1",
        )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")


def finish_run_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Set torch's threads to `--threads`; `--precision` defaults to bf16 autocast on CUDA (how
    the study trains there), plain fp32 on CPU (its fast dtype)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    return args


def clock_of(args: argparse.Namespace) -> Clock:
    """`--clock`'s clock: the process's CPU time or the wall clock."""
    return time.process_time if args.clock == "cpu" else time.perf_counter


def setting(args: argparse.Namespace) -> dict[str, Any]:
    """Where and how a run measured: device, its name, precision, torch's threads."""
    return {
        "device": str(args.device),
        "device_name": device_name(args.device),
        "precision": args.precision,
        "threads": torch.get_num_threads(),
    }


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to `precision` on `device`, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def peak_dtype(precision: str) -> torch.dtype:
    """The matmul dtype a precision runs its products in."""
    return PRECISIONS[precision] or torch.float32


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(
    fn: Callable[[], object], device: str | torch.device, clock: Clock = time.perf_counter
) -> float:
    """Seconds of one call of `fn` by `clock`, between two syncs of `device`."""
    sync(device)
    t = clock()
    fn()
    sync(device)
    return clock() - t


def round_robin(
    steps: dict[str, Callable[[], object]],
    repeat: int,
    device: str | torch.device,
    clock: Clock = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of `repeat` calls of each step, in turns: drifting load affects all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            times[name].append(time_call(step, device, clock))
    return times


def attention_names(spec: str) -> list[str]:
    """`--attention`'s comma-separated variant names, or every registered one for "all"."""
    names = available() if spec == "all" else spec.split(",")
    unknown = [n for n in names if n not in available()]
    if unknown:
        raise UsageExit(f"unknown attention {unknown}; choose from {', '.join(available())}")
    return names


def sized_options(name: str, frames: int) -> dict[str, int]:
    """Variant `name`'s options for `frames` model frames: synthesizers need max_len >= T'."""
    return {"max_len": max(1024, frames)} if "max_len" in attention_options(name) else {}


def check_mfu(mfu: float) -> None:
    if not 0 < mfu <= 1:
        raise UsageExit(f"--mfu must be in (0, 1], got {mfu}")


def write_json(path: Path | None, data: Any, indent: int = 2) -> None:
    """Write `data` to `path` (its folder created), if a path is given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=indent, default=float) + "\n")


def matmul_peak(**kwargs: Any) -> float:
    """Best sustained FLOP/s of square `torch.mm`s (`matmul_series`): the MFU denominator."""
    return max(matmul_series(**kwargs).values())


def matmul_series(
    sizes: Sequence[int] | None = None,
    seconds: float | None = None,
    repeat: int = 2,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    clock: Clock = time.perf_counter,
) -> dict[int, float]:
    """{n: best sustained FLOP/s of n x n x n products}: per size a timed warm-up, then `repeat`
    series of back-to-back products into one output, each lasting about `seconds` (default
    0.2 s on CUDA, 0.05 s on CPU). One product is a poor peak: a GPU raises its clocks under
    sustained load and a launch has its own overhead; small sizes do not fill an H100 and large
    ones do not fit a CPU's caches, hence several. A size whose one product would take over
    20 x `seconds` at the best rate so far is skipped (bf16 on a CPU without bf16 units)."""
    cuda = torch.device(device).type == "cuda"
    sizes = sizes or ((2048, 4096, 8192) if cuda else (512, 1024, 2048))
    seconds = seconds if seconds is not None else (0.2 if cuda else 0.05)

    def products(a: Tensor, b: Tensor, out: Tensor, count: int) -> float:
        """Seconds of `count` back-to-back `torch.mm(a, b, out=out)` between two syncs."""
        elapsed = time_call(lambda: [torch.mm(a, b, out=out) for _ in range(count)], device, clock)
        return max(elapsed, 1e-9)

    rates: dict[int, float] = {}
    for n in sorted(sizes):
        flop = 2.0 * n**3
        if rates and flop / max(rates.values()) > 20 * seconds:
            break  # larger sizes only take longer
        mats = [torch.randn(n, n, device=device, dtype=dtype) for _ in range(3)]
        count = max(1, min(10_000, round(seconds / products(*mats, 1))))  # warm-up, sizes a series
        rates[n] = max(count * flop / products(*mats, count) for _ in range(repeat))
    return rates


# the CUDA runtime calls the profiler records for a kernel launch
CUDA_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def profiled(fn: Callable[[], object], device: str | torch.device) -> list:
    """The profiler's events of one call of `fn` (CPU activity, and CUDA's on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    return list(prof.events())


def count_kernels(fn: Callable[[], object], device: str | torch.device) -> int:
    """Kernels one call of `fn` starts, from the profiler: CUDA kernel launches on CUDA; on
    the CPU the operator calls made from Python or autograd (`aten::matmul`'s own `aten::mm`
    is part of it)."""
    events = profiled(fn, device)
    if torch.device(device).type == "cuda":
        return sum(e.name in CUDA_LAUNCHES for e in events)

    def is_op(e) -> bool:  # a dispatched operator, not an autograd node or a user range
        return "::" in e.name and not e.name.startswith(("autograd::", "profiler::"))

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None and not is_op(parent):
            parent = parent.cpu_parent
        return parent is None

    return sum(is_op(e) and outermost(e) for e in events)


def device_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU model and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    found = re.search(r"^model name\s*:\s*(.*)$", _read("/proc/cpuinfo"), re.M)
    model = found.group(1).strip() if found else "CPU"
    return f"{model}, {torch.get_num_threads()} threads of {os.cpu_count()} cores"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _kib(text: str, key: str) -> int | None:
    """The `key:  N kB` field of a /proc file's `text`, in bytes (None where absent)."""
    found = re.search(rf"{key}:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else None


def rss_resettable() -> bool:
    """Whether the peak resident set size (VmHWM) can be reset via /proc/self/clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:  # not Linux, or /proc/self/clear_refs not writable
        return False


def peak_memory(fn: Callable[[], object], device: torch.device) -> float | None:
    """MiB that `fn()` adds at its peak: the CUDA allocator's peak rise, or on CPU the peak
    resident set size's (freed heap trimmed, VmHWM reset first; None where unreadable)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if not rss_resettable():
        return None
    base = _kib(_read("/proc/self/status"), "VmRSS")
    fn()
    return (_kib(_read("/proc/self/status"), "VmHWM") - base) / 2**20


def available_memory(device: torch.device) -> float | None:
    """MiB the next allocations can still take: free CUDA memory, or MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    free = _kib(_read("/proc/meminfo"), "MemAvailable")
    return None if free is None else free / 2**20
