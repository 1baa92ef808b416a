"""Speed and memory of every attention variant vs sequence length (the study's Table 1;
docs/benchmarks.md, "Attention speed", says what each row and figure is).

Every case trains one layer on x (B, T, D), the cases at one T taking turns; gradients are
reset to None around each step, as `optimizer.zero_grad()` does, and two-kernel variants
choose their kernel (`attention.autotune`) before the warm-up, outside every figure.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import Attention, autotune, available, build, registry
from speechattn.attention.base import linear_flops
from speechattn.attention.lsh import SCHEMES
from speechattn.bench.common import (
    Clock,
    add_run_arguments,
    autocast,
    available_memory,
    clock_of,
    count_kernels,
    finish_run_arguments,
    matmul_peak,
    parser,
    peak_dtype,
    peak_memory,
    rss_resettable,
    setting,
    time_call,
    write_json,
)

DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192]
QUICK_LENGTHS = [128, 256, 512, 1024]
SLOWDOWN_LIMIT = 1.1  # a variant with fewer FLOPs than full may take at most this x full's time
# at this length and above, variants keep this share of their FLOP-bound speed-up
BOUND_MIN_T = 4096
LSH = set(SCHEMES)
BASELINES = ["sdpa_mha", "sdpa_kernel"]
BOUND_SHARE = {"ldsa": 0.7, "sparse_": 0.7, **{n: 0.6 for n in LSH}}  # by name or prefix
TARGET_LENGTHS = (128, 8192)  # the range the slowdown limit applies to
MEMORY_SHARE = 0.8  # a case's peak may take this share of the memory still available
FLEX = "+flex"  # row suffix: the variant with kernel="flex" (CUDA runs add these rows)


def variant_of(row: str) -> tuple[str, dict]:
    """A result row's registry name and the options that distinguish it."""
    if row.endswith(FLEX):
        return row.removesuffix(FLEX), {"kernel": "flex"}
    return row, {}


class BareMHA(nn.Module):
    """`full` without speechattn: qkv Linear -> SDPA -> out Linear (no masks, no checks)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.h = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)  # (B, h, T, d_k)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class KernelOnly(nn.Module):
    """The SDPA call alone on (B, h, T, d_k) leaf tensors."""

    def forward(self, qkv: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return F.scaled_dot_product_attention(*qkv)


def saved_bytes(fn: Callable[[], Tensor], params: list[Tensor]) -> float:
    """MiB of distinct storages `fn()` saves for backward (`saved_tensors_hooks`), not counting
    storages of `params` (saving a parameter costs no memory)."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: Tensor) -> Tensor:
        if t.numel() and t.untyped_storage().data_ptr() not in skip:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


class Case:
    """One benchmarked row at one length T: its module, its leaf inputs (x (B, T, D), or q, k,
    v (B, h, T, d_k) for `sdpa_kernel`) and one training step."""

    def __init__(self, name: str, T: int, args: argparse.Namespace, device: torch.device) -> None:
        self.name, self.T, self.device, self.args = name, T, device, args
        B, D, h = args.batch, args.dim, args.heads
        variant, self.options = variant_of(name)
        if name == "sdpa_mha":
            self.module: nn.Module = BareMHA(D, h)
        elif name == "sdpa_kernel":
            self.module = KernelOnly()
        else:
            if registry.options(variant).get("max_len", T) < T:
                self.options["max_len"] = T
            self.module = build(variant, D, h, **self.options)
            autotune.enable(self.module, args.autotune == "on")
        self.module.to(device)
        gen = torch.Generator().manual_seed(T)
        shapes = [(B, h, T, D // h)] * 3 if name == "sdpa_kernel" else [(B, T, D)]
        self.leaves = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
        self.inputs = tuple(self.leaves) if name == "sdpa_kernel" else self.leaves[0]
        if getattr(self.module, "autotune", False):
            with torch.no_grad():  # choose the kernel now: outside every timed or measured step
                self.forward()

    def forward(self) -> Tensor:
        with autocast(self.device.type, self.args.precision):
            return self.module(self.inputs)

    def flops(self) -> float:
        """Training FLOPs of one step (forward + backward) as the module is defined."""
        B, T, D = self.args.batch, self.T, self.args.dim
        if isinstance(self.module, Attention):
            return B * self.module.flops(T).training
        attention = 3 * 4.0 * T * T * D  # SDPA: scores and weighted sums, forward + backward
        projections = 3 * linear_flops(T, D, 4 * D) if self.name == "sdpa_mha" else 0.0
        return B * (attention + projections)

    def _zero(self) -> None:
        for t in [*self.module.parameters(), *self.leaves]:
            t.grad = None

    def step(self) -> None:
        self.time_step(time.perf_counter)

    def time_step(self, clock: Clock) -> float:
        """Milliseconds of one training step (forward + backward) by `clock`."""
        self._zero()
        ms = 1000 * time_call(lambda: self.forward().float().sum().backward(), self.device, clock)
        self._zero()  # free gradients (large for synthesizer tables) before the next case
        return ms

    def time_select(self, clock: Clock) -> float:
        """LSH only: hashing + matching + top-k on this input, no gradient (ms)."""
        attn: Attention = self.module
        with torch.no_grad(), autocast(self.device.type, self.args.precision):
            valid = torch.ones(self.inputs.shape[:2], dtype=torch.bool, device=self.device)
            q, k, _ = attn._qkv(self.inputs)
            return 1000 * time_call(lambda: attn.select(q, k, valid), self.device, clock)


def other_kernel(case: Case, clock: Clock, reps: int) -> dict | None:
    """For a two-kernel variant: the kernel it did not use at this length, timed like the
    one it used ({"kernel", "ms"}), or why it was not timed ({"kernel", "skipped"}); None for
    one-kernel modules. Shows whether any of its kernels can meet a target it missed."""
    module = case.module
    if not isinstance(module, Attention) or module.short_path_max_t is None:
        return None
    other = "long" if autotune.used(module, case.T).rstrip("*") == "short" else "short"
    if other == "short" and autotune.timed_shape(module, case.inputs, case.T) is None:
        return {"kernel": other, "skipped": "its (B, h, T, T) scores exceed the tuner's budget"}
    with autotune.forced(module, other):
        try:
            case.step()  # warm-up
            return {"kernel": other, "ms": min(case.time_step(clock) for _ in range(reps))}
        except (RuntimeError, MemoryError) as err:
            return {"kernel": other, "skipped": str(err).splitlines()[0][:120]}


def why_missed(r: dict, T: int, full_ms: float) -> str:
    """Why a variant is slower than the limit at T, from what the run measured."""
    used = r.get("kernel", {}).get(T, "one").rstrip("*")
    reasons = []
    other = r.get("other_kernel", {}).get(T)
    if other and "ms" in other:
        ratio = other["ms"] / full_ms
        verdict = "the other kernel would: the measured choice differs from this run"
        if ratio > SLOWDOWN_LIMIT:
            verdict = "neither kernel meets the limit"
        reasons.append(
            f"{used} kernel used; the {other['kernel']} kernel takes {ratio:.2f}x "
            f"full's time: {verdict}"
        )
    elif other:
        reasons.append(
            f"{used} kernel used; the {other['kernel']} one not run ({other['skipped']})"
        )
    elif used == "one":
        reasons.append("one kernel only")
    if T in r.get("select_ms", {}):
        reasons.append(
            f"hashing + matching + top-k alone take {r['select_ms'][T] / full_ms:.2f}x full's "
            f"time, the attention over the selected keys {r['attention_ms'][T] / full_ms:.2f}x "
            "(selection overhead)"
        )
    return "; ".join(reasons)


def growth_exponent(times: dict[int, float]) -> float | None:
    """Slope of log(time) vs log(T) over T >= max(T) / 8 (least squares)."""
    top = max((T for T, t in times.items() if t and t > 0), default=0)
    pts = [(math.log(T), math.log(t)) for T, t in times.items() if t and t > 0 and T >= top / 8]
    return statistics.linear_regression(*zip(*pts)).slope if len(pts) >= 2 else None


def row_names(args: argparse.Namespace, device: torch.device) -> tuple[list[str], list[str]]:
    """(variant rows, all rows): the chosen variants with `full` first where missing (every
    ratio is to it), their `+flex` rows on CUDA, then the SDPA baselines."""
    names = args.variants or available()
    if "full" not in names:
        names = ["full", *names]
    if device.type == "cuda":  # FlexAttention kernels train on CUDA only
        names += [n + FLEX for n in names if "kernel" in registry.options(n)]
    return names, names + ([] if args.no_baselines else BASELINES)


def build_cases(
    T: int,
    rows: list[str],
    args: argparse.Namespace,
    device: torch.device,
    warmup_peak: dict[str, tuple[int, float]],
    res: dict[str, dict],
) -> dict[str, Case]:
    """Every row's case at length T, built and warmed up once, unless its peak memory,
    predicted from its last warm-up (x length ratio squared) or measured at this warm-up,
    would not fit in MEMORY_SHARE of the memory available. Updates `warmup_peak`; a case
    left out (memory guard, build or warm-up failure) is recorded in its row's `errors`."""

    def skip(n: str, T: int, why: str) -> None:
        res[n].setdefault("errors", {})[T] = why
        print(f"  T={T} {n}: skipped ({why})", file=sys.stderr, flush=True)

    cases = {}
    for n in rows:
        if n in warmup_peak:
            T0, mb = warmup_peak[n]
            predicted, free = mb * (T / T0) ** 2, available_memory(device)
            if free is not None and predicted > MEMORY_SHARE * free:
                skip(n, T, f"predicted peak {predicted:.0f} MiB, {free:.0f} MiB available")
                continue
        try:
            cases[n] = Case(n, T, args, device)
            peak = peak_memory(cases[n].step, device)  # warm-up
        except (RuntimeError, MemoryError) as err:  # e.g. out of memory: record and go on
            cases.pop(n, None)
            skip(n, T, str(err).splitlines()[0][:200])
            continue
        if peak is not None:
            warmup_peak[n] = (T, peak)
    free = available_memory(device)  # every case of this length is built now
    for n in list(cases):
        if free is not None and n in warmup_peak and warmup_peak[n][1] > MEMORY_SHARE * free:
            del cases[n]
            skip(n, T, f"peak {warmup_peak[n][1]:.0f} MiB, {free:.0f} MiB available")
    return cases


def time_cases(
    cases: dict[str, Case], args: argparse.Namespace, clock: Clock
) -> tuple[dict[str, list[float]], int]:
    """(step times in ms per case, steps per case): `--reps` steps at least, more while
    `full`'s steps add up to less than `--min-time`; the cases take turns (interleaved)."""
    samples: dict[str, list[float]] = {n: [] for n in cases}
    reps = args.reps
    if "full" in cases:
        reps = max(reps, math.ceil(args.min_time * 1000 / cases["full"].time_step(clock)))
    for _ in range(reps):
        for n, case in cases.items():
            samples[n].append(case.time_step(clock))
    return samples, reps


def record_case(
    r: dict, case: Case, times: list[float], full_ms: float | None, reps: int, clock: Clock
) -> None:
    """Store what was measured for `case` at its length in its row `r`."""
    T = case.T

    def put(key: str, value: object) -> None:
        r.setdefault(key, {})[T] = value

    put("time_ms", min(times))
    if full_ms and min(times) > SLOWDOWN_LIMIT * full_ms:  # a target may be missed
        other = other_kernel(case, clock, reps)
        if other is not None:
            put("other_kernel", other)
    put("time_ms_median", statistics.median(times))
    if case.name in LSH:
        select = min(case.time_select(clock) for _ in range(reps))
        put("select_ms", select)
        put("attention_ms", max(min(times) - select, 1e-3))
    if not case.args.no_memory:
        put("peak_mem_mb", peak_memory(case.step, case.device))
        put("saved_mb", saved_bytes(case.forward, list(case.module.parameters())))
    put("gflop", case.flops() / 1e9)
    put("kernels", count_kernels(case.step, case.device))
    put("params_at_T", sum(p.numel() for p in case.module.parameters()))
    if case.options:
        put("options_at_T", case.options)
    if isinstance(case.module, Attention):
        put("keys_attended", case.module.keys_attended(T))
        put("kernel", autotune.used(case.module, T))


def derive(r: dict, full: dict, peak: float) -> None:
    """A row's figures relative to `full`'s row and to the matmul `peak` (FLOP/s)."""
    full_ms, full_gflop = full["time_ms"], full["gflop"]
    r["ratio_to_full"] = {T: full_ms[T] / t for T, t in r["time_ms"].items() if T in full_ms}
    r["flop_bound"] = {T: full_gflop[T] / g for T, g in r["gflop"].items() if T in full_gflop}
    r["achieved_of_bound"] = {
        T: r["ratio_to_full"][T] / b for T, b in r["flop_bound"].items() if T in r["ratio_to_full"]
    }
    r["mfu"] = {T: r["gflop"][T] * 1e9 / (t / 1e3) / peak for T, t in r["time_ms"].items()}
    r["growth_exponent"] = growth_exponent(r["time_ms"])
    if "attention_ms" in r:
        r["attention_growth_exponent"] = growth_exponent(r["attention_ms"])


def describe(n: str, args: argparse.Namespace) -> dict:
    """A row's definition: complexity, and for a variant its paper, parameters and options."""
    if n in BASELINES:
        return {"complexity": "O(T^2 D)" if n == "sdpa_mha" else "O(T^2 d_k h)"}
    variant, options = variant_of(n)
    attn = build(variant, args.dim, args.heads, **options)
    keys = ("paper", "complexity", "complexity_training", "complexity_inference")
    return {
        **{k: getattr(attn, k) for k in keys},
        "params": sum(p.numel() for p in attn.parameters()),
        "options": {**registry.options(variant), **options},
    }


def run_meta(args: argparse.Namespace, peak: float, reps_at: dict) -> dict:
    """How the run measured: machine, precision, sizes, steps per length, clocks."""
    memory = "unavailable"
    if torch.device(args.device).type == "cuda":
        memory = "cuda max_memory_allocated rise"
    elif rss_resettable():
        memory = "peak RSS rise (VmHWM after /proc/self/clear_refs reset)"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        **setting(args),
        "matmul_peak_gflops": peak / 1e9,
        "autotune": args.autotune,
        "batch": args.batch,
        "dim": args.dim,
        "heads": args.heads,
        "lengths": args.lengths,
        "reps": reps_at,
        "timing": f"forward+backward {args.clock} time, min over reps after one warm-up",
        "memory": memory,
        "saved_mb": "bytes of distinct non-parameter storages saved for backward "
        "(saved_tensors_hooks)",
    }


def run(args: argparse.Namespace) -> dict:
    """Every row at every length, then the derived figures, definitions, metadata, targets."""
    device = torch.device(args.device)
    names, rows = row_names(args, device)
    clock = clock_of(args)
    peak = matmul_peak(device=args.device, dtype=peak_dtype(args.precision), clock=clock)
    keys = ("time_ms", "time_ms_median", "peak_mem_mb", "saved_mb", "gflop")
    res: dict[str, dict] = {n: {k: {} for k in keys} for n in rows}
    torch.manual_seed(0)
    warmup_peak: dict[str, tuple[int, float]] = {}  # name -> (T, MiB) of its last warm-up
    reps_at: dict[int, int] = {}
    for T in args.lengths:
        cases = build_cases(T, rows, args, device, warmup_peak, res)
        samples, reps_at[T] = time_cases(cases, args, clock)
        full_ms = min(samples["full"]) if "full" in cases else None
        for n, case in cases.items():
            record_case(res[n], case, samples[n], full_ms, reps_at[T], clock)
        line = "  ".join(f"{n}={res[n]['time_ms'][T]:.0f}" for n in cases)
        print(f"T={T}: {line} (ms)", file=sys.stderr, flush=True)
        del cases
    # measured again after the run (the machine may have been busier at its start): the max
    peak = max(peak, matmul_peak(device=args.device, dtype=peak_dtype(args.precision), clock=clock))
    for n in rows:
        derive(res[n], res["full"], peak)
        res[n].update(describe(n, args))
    out = {
        "meta": run_meta(args, peak, reps_at),
        "variants": {n: res[n] for n in names},
        "baselines": {n: res[n] for n in rows if n in BASELINES},
    }
    out["targets"] = targets(out)
    return out


def targets(out: dict) -> list[dict]:
    """For every measured T in TARGET_LENGTHS, each variant with fewer FLOPs than `full` takes
    at most SLOWDOWN_LIMIT x its time; the variants in BOUND_SHARE keep that share of their
    FLOP-bound speed-up at T >= BOUND_MIN_T; `full` is within 10 % of bare SDPA MHA."""
    v, b = out["variants"], out["baselines"]
    lo, hi = TARGET_LENGTHS
    checks = []

    def add(what: str, value: float | None, ok: bool | None) -> None:
        checks.append({"target": what, "value": value, "met": ok})

    for n, r in v.items():
        if n == "full":
            continue
        for T, bound in r["flop_bound"].items():
            if not lo <= T <= hi or bound <= 1 or T not in r["ratio_to_full"]:
                continue
            slowdown = 1 / r["ratio_to_full"][T]
            add(
                f"{n} at T={T}: time <= {SLOWDOWN_LIMIT}x full's (FLOP bound {bound:.2f})",
                slowdown,
                slowdown <= SLOWDOWN_LIMIT,
            )
            if slowdown > SLOWDOWN_LIMIT:
                checks[-1]["why"] = why_missed(r, T, v["full"]["time_ms"][T])
        need = next((s for k, s in BOUND_SHARE.items() if n.startswith(k)), None)
        if need is not None:
            for T, share in r["achieved_of_bound"].items():
                if T >= BOUND_MIN_T:
                    add(
                        f"{n} at T={T}: >= {need:.0%} of its FLOP-bound speed-up",
                        share,
                        share >= need,
                    )
    full = v["full"]["time_ms"]
    bare = b.get("sdpa_mha", {}).get("time_ms", {})
    if full and max(full) in bare:
        T = max(full)
        r = full[T] / bare[T]
        add(f"full within 10% of bare SDPA MHA at T={T} (time ratio)", r, r <= 1.10)
    return checks


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("attention", __doc__)
    p.add_argument("--quick", action="store_true", help=f"T {QUICK_LENGTHS}, 2 reps (< 2 min)")
    add_run_arguments(p, devices=["cpu", "cuda"])
    p.add_argument("--png", type=Path, default=None, help="log-log plot (default: next to --json)")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--variants", nargs="+", default=None, help="default: all registered")
    p.add_argument("--reps", type=int, default=None, help="timed steps per case (3; quick 2)")
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timed steps per "
        "case at least (0.5; quick 0.1): short lengths get more steps",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument(
        "--autotune",
        choices=["on", "off"],
        default="on",
        help="two-kernel variants: time both here (on) or the short_path_max_t rule",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    p.add_argument("--no-baselines", action="store_true", help="skip sdpa_mha / sdpa_kernel")
    args = p.parse_args(argv)
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    args.reps = args.reps or (2 if args.quick else 3)
    args.min_time = (0.1 if args.quick else 0.5) if args.min_time is None else args.min_time
    unknown = set(args.variants or []) - set(available())
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; valid: {', '.join(available())}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    return finish_run_arguments(args)


def print_table(out: dict) -> None:
    m, Ts, allrows = out["meta"], out["meta"]["lengths"], {**out["variants"], **out["baselines"]}
    w = max(len(n) for n in allrows) + 2
    header = "variant".ljust(w) + "".join(f"T={T}".rjust(10) for T in Ts)

    def table(
        title: str,
        key: str,
        fmt: str = "{:10.2f}",
        rows: dict = allrows,
        missing: str = f"{'-':>10}",
    ) -> None:
        print(f"\n{title}\n{header}")
        for n, r in rows.items():
            cells = (r.get(key, {}).get(T) for T in Ts)
            print(n.ljust(w) + "".join(missing if c is None else fmt.format(c) for c in cells))

    print(
        f"\n{m['device_name']}; {m['precision']}; matmul peak {m['matmul_peak_gflops']:.1f} GFLOP/s"
    )
    print(
        f"forward+backward {m['timing'].split()[1]} time (ms), B={m['batch']} D={m['dim']} "
        f"h={m['heads']} on {m['device']} ({m['threads']} threads)"
    )
    print(header + "   exp")
    for n, r in allrows.items():
        cells = "".join(f"{r['time_ms'].get(T, float('nan')):10.1f}" for T in Ts)
        exp = r.get("growth_exponent")
        print(n.ljust(w) + cells + (f"  {exp:4.2f}" if exp is not None else "     -"))
    table("speed-up vs full (full time / variant time)", "ratio_to_full")
    table("FLOP bound: flops(full) / flops(variant)", "flop_bound")
    table("achieved / bound (speed-up over FLOP bound)", "achieved_of_bound")
    table("MFU (achieved FLOP/s over the measured matmul peak)", "mfu")
    table(
        "kernels per step (CUDA launches; on the CPU operator calls from Python/autograd)",
        "kernels",
        "{:10d}",
    )
    lsh = {n: r for n, r in allrows.items() if "attention_ms" in r}
    if lsh:
        print("\nLSH: hashing+matching (select) / attention part (ms)")
        for n, r in lsh.items():
            sel, att = r["select_ms"], r["attention_ms"]
            cells = "".join(f"{sel[T]:7.0f}/{att[T]:<7.0f}" for T in Ts if T in sel)
            exp = r["attention_growth_exponent"] or float("nan")
            print(f"{n.ljust(w)}{cells}  attention exp {exp:.2f}")
    two = {n: r for n, r in allrows.items() if set(r.get("kernel", {}).values()) - {"one"}}
    if two:
        how = "measured (*: here or cached)" if m.get("autotune") == "on" else "rule"
        table(
            f"kernel used (short: all T x T pairs, long: the sparse/band one; {how})",
            "kernel",
            "{:>10}",
            two,
        )
    if any(r["peak_mem_mb"] for r in allrows.values()):
        table(f"peak memory (MiB; {m['memory']})", "peak_mem_mb", "{:10.1f}", missing="       n/a")
    print("\ntargets")
    missed = [c for c in out["targets"] if not c["met"]]
    for c in out["targets"]:
        if not c["met"] or len(out["targets"]) <= 40:
            val = "n/a" if c["value"] is None else f"{c['value']:.2f}"
            print(f"  [{'met' if c['met'] else 'MISSED'}] {c['target']}: {val}")
            if c.get("why"):
                print(f"      why: {c['why']}")
    print(f"  {len(out['targets']) - len(missed)} of {len(out['targets'])} met")


def plot(out: dict, path: Path) -> None:
    """Log-log time and memory vs T (also works on a JSON-loaded result with str keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allrows = {**out["variants"], **out["baselines"]}
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>pPX*hH"
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    for i, (n, r) in enumerate(allrows.items()):
        ls = "--" if n in out["baselines"] else "-"
        style = dict(ls=ls, marker=markers[i % len(markers)], ms=4, color=colors[i % len(colors)])
        for ax, key in zip(axes, ("time_ms", "peak_mem_mb")):
            pts = sorted((int(T), t) for T, t in r.get(key, {}).items() if t)
            if pts:
                ax.plot(*zip(*pts), label=n, **style)
    for ax, label in zip(axes, ("forward+backward time (ms)", "peak memory rise (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel="T (frames)", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    axes[1 if axes[1].lines else 0].legend(fontsize=8, ncol=2, loc="upper left")
    m = out["meta"]
    title = (
        f"attention variants: B={m['batch']}, D={m['dim']}, h={m['heads']}, {m['device']}, "
        f"{m['threads']} thread(s); {m['timing']}"
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    out = run(args)
    print_table(out)
    if args.json:
        write_json(args.json, out, indent=1)
        print(f"\nwrote {args.json}")
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png:
        plot(out, png)
        print(f"wrote {png}")
    return out


if __name__ == "__main__":
    main()
