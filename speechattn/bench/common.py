"""Pieces shared by the benchmarks: device sync, measured matmul peak, precision contexts."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_precision(device: str) -> str:
    """bf16 autocast on CUDA (how the study trains there), plain fp32 on CPU (its fast dtype)."""
    return "bf16" if device.startswith("cuda") else "fp32"


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    """`--precision fp32|bf16|fp16`; None until resolved with `default_precision`."""
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default=None,
        help="autocast dtype (default: bf16 on cuda, fp32 on cpu)",
    )


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to `precision` on `device`, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(
    n: int = 3072,
    repeat: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best FLOP/s of an n x n x n torch.mm in `dtype` on this device (the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeat):
        sync(device)
        t = clock()
        a @ b
        sync(device)
        best = min(best, clock() - t)
    return 2 * n**3 / best


def peak_dtype(precision: str) -> torch.dtype:
    """The matmul dtype a precision runs its products in."""
    return PRECISIONS[precision] or torch.float32


def device_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU model and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
         if ln.startswith("model name")),
        "CPU",
    )  # fmt: skip
    return f"{model}, {torch.get_num_threads()} threads of {os.cpu_count()} cores"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


class PeakRSS:
    """Peak-RSS rise of one call (Linux): reset VmHWM via /proc/self/clear_refs."""

    def __init__(self) -> None:
        self.ok = Path("/proc/self/clear_refs").exists()
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None
        if self.ok:
            try:
                self._reset()
            except OSError:
                self.ok = False

    @staticmethod
    def _status(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024

    def _reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def measure(self, fn: Callable[[], None]) -> float | None:
        if not self.ok:
            return None
        if self.libc is not None:
            self.libc.malloc_trim(0)
        self._reset()
        base = self._status("VmRSS")
        fn()
        return (self._status("VmHWM") - base) / 2**20


def peak_memory(fn: Callable[[], object], device: torch.device, rss: PeakRSS) -> float | None:
    """MiB that `fn()` adds at its peak: the CUDA allocator's peak rise on CUDA, the peak
    resident set size's rise on CPU (None where that cannot be read)."""
    if device.type != "cuda":
        return rss.measure(fn)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def available_memory(device: torch.device) -> float | None:
    """MiB the next allocations can still take: free CUDA memory, or the kernel's
    MemAvailable on CPU (None where that cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    found = re.search(r"MemAvailable:\s+(\d+) kB", _read("/proc/meminfo"))
    return int(found.group(1)) / 1024 if found else None
