"""One command that measures everything a short GPU lease can: every variant's training step
(docs/gpu.md, "One command for a GPU lease", describes each case and field).

No case starts after `--deadline` seconds from `$SPEECHATTN_LEASE_T0` (else this process's
start) minus what the longest case of its kind took so far. `--device cpu --tiny` checks the
command itself; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from speechattn.attention import autotune, registry
from speechattn.bench.common import (
    CUDA_LAUNCHES,
    attention_names,
    device_name,
    matmul_peak,
    parser,
    profiled,
    time_call,
)
from speechattn.errors import UsageExit

FEATURE_DIM = 80
TINY = [
    "model.net.dim=64",
    "model.net.num_layers=2",
    "model.net.num_heads=4",
    "model.net.ffn_dim=128",
    "data.batch_size=2",
    "data.max_frames=300",
]
TINY_SHAPES = "tiny (2 layers, D 64, batch 2 x 300)"
# first guesses of a case's seconds on a GPU, before one of its kind has run
FIRST_GUESS = {"step": 20.0, "flex": 60.0, "compiled": 120.0, "lightning": 90.0}
# the CUDA runtime calls the profiler records for host waits
RUNTIME_SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
# (backend, substrings of its CUDA kernels' names), the first match wins
ATTENTION_KERNELS = (
    ("cudnn", ("cudnn_generated_fort_native_sdpa", "cudnn::fusion::compute_dot_do_o")),
    ("flash", ("pytorch_flash::", "flash_fwd", "flash_bwd")),
    ("efficient", ("fmha_cutlass", "PyTorchMemEffAttention")),
    ("flex", ("flex_attention",)),
)


class InjectedFailure(RuntimeError):
    """`--inject-failure`: the harness's own test of a failing case."""


class Results:
    """`lease.jsonl`, one line per case, appended and synced as it ends; `done`: each case's
    last line. On resume a case that started and never ended is recorded as crashed."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        if not resume:
            path.unlink(missing_ok=True)
        elif path.is_file():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if "case" in entry:
                        self.done[entry["case"]] = entry
        for case, entry in list(self.done.items()):
            if entry.get("status") == "started":
                self.write(
                    {
                        "case": case,
                        "status": "crashed",
                        "error": "the process died during this case",
                    }
                )

    def write(self, entry: dict[str, Any]) -> None:
        if "case" in entry:
            self.done[entry["case"]] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def compose_case(args: argparse.Namespace, name: str, *extra: str):  # noqa: ANN201 - DictConfig
    """The pretraining config of variant `name` as `experiment=paper` has it (or --tiny)."""
    from speechattn.config import compose

    trainer = "trainer=gpu" if args.device == "cuda" else "trainer=cpu"
    overrides = ["experiment=paper", f"attention={name}", trainer, *(TINY if args.tiny else [])]
    cfg = compose("pretrain", [*overrides, *extra])
    cfg.model.net.feature_dim = FEATURE_DIM
    return cfg


class Step:
    """One training step of `PretrainTask` as Lightning's loop runs it (`syncs.train_step`), on
    two batches taken in turn, cropped, padded and masked as the loader delivers them."""

    def __init__(self, cfg: Any, device: torch.device, compiled: bool = False) -> None:
        from speechattn.bench.pretrain import crop_batch
        from speechattn.model.optim import build_optimizer
        from speechattn.tasks.pretrain.module import PretrainTask
        from speechattn.utils import plain

        torch.manual_seed(0)
        self.device, self.count = device, 0
        self.loss: torch.Tensor | None = None
        self.task = (
            PretrainTask(
                model=plain(cfg.model.net),
                masking=plain(cfg.model.masking),
                optimizer=plain(cfg.model.optimizer),
                compile=compiled,
            )
            .to(device)
            .train()
        )
        autotune.enable(self.task.model, bool(cfg.attention.get("autotune", True)))
        self.optimizer = build_optimizer(self.task, self.task.optim)
        masker = self.task.batch_masker(pad_to_multiple=int(cfg.data.pad_to_multiple))
        self.batches = []
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            features, lengths = crop_batch(int(cfg.data.batch_size), int(cfg.data.max_frames), g)
            masked = masker(features, lengths, seed=seed)
            masked = masked.pin_memory() if device.type == "cuda" else masked
            self.batches.append({"masked": masked, "lengths": lengths})
        self.flops = statistics.fmean(useful_flops(cfg, b["lengths"]) for b in self.batches)
        self.frames = int(self.batches[0]["masked"].inputs.shape[1])  # padded model frames

    def __call__(self) -> None:
        from speechattn.bench.syncs import train_step

        batch = self.batches[self.count % len(self.batches)]
        self.count += 1
        data = {"masked": batch["masked"].to(self.device), "lengths": batch["lengths"]}
        self.loss = train_step(self.task, self.optimizer, data, bf16=self.device.type == "cuda")


def useful_flops(cfg: Any, lengths: torch.Tensor) -> float:
    """Training FLOPs of one step, each utterance at its own length (padding is no work)."""
    from speechattn.bench.pretrain import step_flops
    from speechattn.model.aalbert import ModelConfig
    from speechattn.utils import plain

    config = ModelConfig(**plain(cfg.model.net))
    frames = Counter(-(-n // config.stack) for n in lengths.tolist())  # model frames: count
    return sum(step_flops(config, count, n) for n, count in frames.items())


def timed(step: Step, n: int) -> list[float]:
    """Milliseconds of `n` steps each: CUDA events on a GPU, the wall clock elsewhere."""
    times = []
    for _ in range(n):
        if step.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(1e3 * time_call(step, step.device))
    return times


def attention_backend(kernel_names: list[str]) -> str:
    """Which `ATTENTION_KERNELS` a step ran, joined by "+", or "none"."""
    found = [
        name
        for name, marks in ATTENTION_KERNELS
        if any(m in k for k in kernel_names for m in marks)
    ]
    return "+".join(found) or "none"


def profile_step(step: Step) -> dict[str, Any]:
    """Kernel launches, CUDA runtime syncs and copies, and the attention backend of one step."""
    events = profiled(step, step.device)
    names = Counter(e.name for e in events)
    kernels = sorted({e.name for e in events if e.device_type.name == "CUDA"})
    return {
        "launches": sum(v for k, v in names.items() if k in CUDA_LAUNCHES),
        "runtime_syncs": sum(v for k, v in names.items() if k in RUNTIME_SYNCS),
        "memcpy_calls": sum(v for k, v in names.items() if k.startswith("cudaMemcpy")),
        "backend": attention_backend(kernels) if step.device.type == "cuda" else "cpu",
    }


def count_syncs(step: Step) -> dict[str, Any]:
    """Host reads and blocking uploads over one step, with where each comes from; on CUDA
    also the calls `torch.cuda.set_sync_debug_mode` warns about."""
    from speechattn.bench.syncs import SyncCounter

    batch = step.batches[step.count % len(step.batches)]
    host = [batch["lengths"], batch["masked"].lengths]
    with SyncCounter(host=host, cpu_is_device=step.device.type == "cpu", trace=True) as counter:
        step()
    out = {
        "reads": counter.count,
        "uploads": counter.upload_count,
        "sync_reasons": {**counter.reasons, **counter.uploads},
        "sync_where": dict(counter.where),
    }
    if step.device.type == "cuda":
        # torch warns once per process unless told to warn always
        always = torch.is_warn_always_enabled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.set_warn_always(True)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                torch.set_warn_always(always)
        out["sync_debug_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
    return out


def run_step_case(
    args: argparse.Namespace, name: str, extra: list[str], compiled: bool, peak: float
) -> dict[str, Any]:
    """Build, warm up, time, count and profile one variant's training step."""
    if name in (args.inject_failure or "").split(","):
        raise InjectedFailure(f"--inject-failure {name}")
    if name in (args.inject_crash or "").split(","):
        os._exit(3)  # the harness's test of a case that takes the process down
    cfg = compose_case(args, name, *extra)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # dynamo's per-process compile count failed a Flex case (docs/gpu.md)
    step = Step(cfg, device, compiled=compiled)
    # the autotuner measures in the warm-up, and compilation happens there
    warmup_s = time_call(lambda: [step() for _ in range(args.warmup)], device)
    times = timed(step, args.steps)
    ms = statistics.median(times)
    row: dict[str, Any] = {
        "ms": ms,
        "ms_min": min(times),
        "warmup_s": warmup_s,
        "frames": step.frames,
        "useful_tflop": step.flops / 1e12,
        "mfu": step.flops / (ms / 1e3) / peak,
        "loss": float(step.loss),
        "finite": bool(torch.isfinite(step.loss)),
    }
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for part in (count_syncs, profile_step):  # each may fail alone (e.g. a dispatch mode)
        try:
            row.update(part(step))
        except Exception as err:  # noqa: BLE001 - recorded, the timing stands
            row[f"{part.__name__}_error"] = f"{type(err).__name__}: {err}"[:500]
    row["kernels"] = autotune.choices(step.task.model).get("choices", {})
    return row


def run_lightning(args: argparse.Namespace) -> dict[str, Any]:
    """`--lightning-steps` of `full` by `speechattn.pretrain.run`: its frames/s and data_wait."""
    from speechattn.tasks.common import read_metrics
    from speechattn.tasks.pretrain import run
    from speechattn.tasks.pretrain.model_card import median_metric

    n = args.lightning_steps
    with tempfile.TemporaryDirectory(prefix="lease_") as folder:
        cfg = compose_case(
            args,
            "full",
            "data=embedded",
            f"trainer.max_steps={n}",
            f"trainer.val_check_interval={n}",
            f"trainer.log_every_n_steps={max(1, n // 10)}",
            f"checkpoint.every_n_steps={n}",
            "progress_bar=none",
            "logger=none",
            f"output_dir={folder}",
        )
        t0 = time.perf_counter()
        result = run(cfg)
        rows = read_metrics(Path(folder) / "metrics.csv")
    return {
        "steps": result["steps"],
        "wall_s": time.perf_counter() - t0,
        "frames_per_s": median_metric(rows, "frames_per_s"),
        "data_wait": median_metric(rows, "data_wait"),
        "val_loss": result["val_loss"],
    }


def cases(args: argparse.Namespace) -> list[tuple[str, str, list[str], bool]]:
    """(case name, kind, config overrides, compiled) in the order they run."""
    names = ["full", *[n for n in args.variants if n != "full"]]
    plan = [(n, "step", [], False) for n in names]
    flex = names if args.flex == "all" else [] if args.flex == "none" else args.flex.split(",")
    for n in flex:
        if "kernel" in registry.options(n):
            plan.append((f"{n}:flex", "flex", ["attention.options.kernel=flex"], False))
    if args.lightning_steps:
        plan.append(("full:lightning", "lightning", [], False))
    # compiled last: minutes of compilation each, the first cases the deadline drops
    plan += [(f"{n}:compiled", "compiled", [], True) for n in args.compiled if n]
    return plan


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """Device, versions, the matmul peak in the step's compute dtype."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    peak = matmul_peak(device=args.device, dtype=dtype, seconds=0.2 if args.tiny else None)
    info = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "peak_dtype": str(dtype).removeprefix("torch."),
        "peak_tflops": peak / 1e12,
        "shapes": TINY_SHAPES if args.tiny else "paper (aalbert_base, 50 x 1500 frames)",
    }
    if args.device == "cuda":
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return info


def start_time() -> float:
    """`$SPEECHATTN_LEASE_T0` (epoch seconds) when set, else now."""
    with contextlib.suppress(KeyError, ValueError):
        return float(os.environ["SPEECHATTN_LEASE_T0"])
    return time.time()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = start_time()
    results = Results(args.out / "lease.jsonl", args.resume)
    if "machine" not in results.done:
        results.write({"case": "machine", **machine(args)})
    peak = results.done["machine"]["peak_tflops"] * 1e12
    took: dict[str, float] = {}  # kind -> the longest case of that kind so far
    for case, kind, extra, compiled in cases(args):
        if case in results.done:
            continue
        guess = took.get(kind, FIRST_GUESS[kind] if args.device == "cuda" else 0.0)
        if time.time() - t0 + guess > args.deadline:
            results.write(
                {"case": case, "status": "skipped", "error": f"deadline: {args.deadline:.0f} s"}
            )
            continue
        results.write({"case": case, "status": "started"})
        print(f"[{time.time() - t0:6.1f} s] {case}", flush=True)
        began = time.time()  # the deadline's clock
        try:
            if kind == "lightning":
                row = run_lightning(args)
            else:
                row = run_step_case(args, case.split(":")[0], extra, compiled, peak)
            entry = {"case": case, "kind": kind, "status": "ok", **row}
        except Exception as err:  # noqa: BLE001 - recorded; the next case runs
            entry = {
                "case": case,
                "kind": kind,
                "status": "failed",
                "error": f"{type(err).__name__}: {err}"[:1000],
                "traceback": traceback.format_exc()[-2000:],
            }
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize() if args.device == "cuda" else None
        entry["seconds"] = time.time() - began
        full_ms = (entry if case == "full" else results.done.get("full", {})).get("ms")
        if full_ms and entry.get("ms"):  # full runs first
            entry["vs_full"] = entry["ms"] / full_ms
        took[kind] = max(took.get(kind, 0.0), entry["seconds"])
        results.write(entry)
    summary = summarise(results.done, time.time() - t0)
    results.write(summary)
    table = verdict(results.done, summary)
    (args.out / "lease.md").write_text(table + "\n")
    print(table)
    print(f"results: {args.out / 'lease.jsonl'} (one JSON line per case), {args.out / 'lease.md'}")
    return list(results.done.values())


def summarise(done: dict[str, dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """The summary line: counts by status, the ratio of each step case to `full`."""
    steps = {k: v for k, v in done.items() if v.get("kind") in ("step", "flex", "compiled")}
    status = Counter(v.get("status") for k, v in done.items() if k != "machine")
    return {
        "summary": True,
        "elapsed_s": elapsed,
        **{f"n_{k}": n for k, n in status.items()},
        "vs_full": {k: v.get("vs_full") for k, v in steps.items()},
    }


# the table's columns: (heading, the entry's field, format); MFU is shown in percent
COLUMNS = (
    ("ms/step", "ms", ".1f"),
    ("vs full", "vs_full", ".2f"),
    ("MFU %", "mfu", "%"),
    ("peak GiB", "peak_gib", ".1f"),
    ("finite", "finite", ""),
    ("reads", "reads", "d"),
    ("uploads", "uploads", "d"),
    ("sync warn", "sync_debug_warnings", "d"),
    ("memcpy", "memcpy_calls", "d"),
    ("rt syncs", "runtime_syncs", "d"),
    ("launches", "launches", "d"),
)


def verdict(done: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    """A one-screen markdown table of the cases."""
    m = done.get("machine", {})
    heads = ["case", "status", *(c[0] for c in COLUMNS), "attention kernel"]
    lines = [
        f"{m.get('device')}, torch {m.get('torch')}, CUDA {m.get('cuda')}, cuDNN "
        f"{m.get('cudnn')}; {m.get('peak_dtype')} matmul peak {m.get('peak_tflops', 0):.1f} "
        f"TFLOP/s; {m.get('shapes')}; {summary['elapsed_s']:.0f} s",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "---|" * len(heads),
    ]

    def f(v: Any, fmt: str) -> str:  # "%": a share shown in percent
        if not isinstance(v, (int, float)):
            return "" if v is None else str(v)
        return format(100 * v, ".1f") if fmt == "%" else format(v, fmt)

    for case, e in done.items():
        if case != "machine" and e.get("kind") != "lightning":
            cells = [case, e.get("status"), *(f(e.get(k), fmt) for _, k, fmt in COLUMNS)]
            lines.append("| " + " | ".join(map(str, cells)) + f" | {e.get('backend', '')} |")
    light = done.get("full:lightning")
    if light is not None and light.get("status") == "ok":
        fps, wait = light.get("frames_per_s"), light.get("data_wait")
        lines.append(
            f"\nLightning, full, {light['steps']} steps on the built-in corpus: "
            f"{f(fps, ',.0f')} frames/s (10 ms), data_wait {f(wait, '.3f')}, "
            f"{light['wall_s']:.0f} s"
        )
    elif light is not None:
        lines.append(f"\nLightning run of full: {light.get('status')} {light.get('error', '')}")
    for case, e in done.items():
        if e.get("status") in ("failed", "crashed"):
            lines.append(f"- {case}: {e.get('status')}: {str(e.get('error'))[:200]}")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("lease", __doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (harness check)")
    p.add_argument("--out", type=Path, default=Path("gpu_results"))
    p.add_argument(
        "--deadline",
        type=float,
        default=360.0,
        help="seconds from the lease's start after which no case starts",
    )
    p.add_argument("--variants", default="all", help="comma-separated names, or all")
    p.add_argument("--flex", default="all", help="variants to run with kernel=flex: all|none|A,B")
    p.add_argument(
        "--compiled",
        default=None,
        help="variants to run with model.compile=true "
        "('' none; default full,xbox,sign_alsh,ldsa on cuda, none on cpu, where each "
        "compiles for minutes)",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (autotuning)")
    p.add_argument("--lightning-steps", type=int, default=30, help="0: no Lightning run")
    p.add_argument("--resume", action="store_true", help="keep DIR/lease.jsonl, skip done cases")
    p.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject-crash", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = attention_names(args.variants)
    if args.compiled is None:
        # LSH's selection is many memory passes eagerly; compiled, inductor fuses them
        args.compiled = "full,xbox,sign_alsh,ldsa" if args.device == "cuda" else ""
    args.compiled = [n for n in args.compiled.split(",") if n]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageExit(
            "--device cuda: no CUDA device here (--device cpu --tiny checks the harness)"
        )
    return args


def main(argv: list[str]) -> None:
    run(parse(argv))
