"""Time the pretraining train loader alone, beside what a GPU step needs from it.

`bench loader OVERRIDES` composes the pretraining config as `python -m speechattn.pretrain`
would and iterates the loader training iterates (`ResumableData.step_loader`), after timing
start-up (`prepare_data()` + `setup()`; `--cold`: on an empty temporary feature cache). The
GPU's need is `bench pretrain --plan`'s projection at `--mfu` of `--gpu`'s dense peak.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from speechattn.bench.common import check_mfu, parser, write_json
from speechattn.bench.pretrain import GPU_PEAKS, project_step
from speechattn.errors import UsageExit

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def open_descriptors(pid: int | str = "self") -> int | None:
    """Open file descriptors of process `pid` (Linux /proc; None where unreadable)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def child_pids() -> list[int]:
    """Live child processes of this process (the DataLoader's workers), from /proc."""
    pids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            text = Path(f"/proc/self/task/{task}/children").read_text()
            pids += [int(p) for p in text.split()]
    except OSError:
        return []
    return sorted(set(pids))


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of process `pid` so far (0.0 where /proc is unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def finished_children_cpu() -> float:
    """CPU seconds of the children this process has waited for (extraction pools)."""
    times = os.times()
    return times.children_user + times.children_system


def measure(cfg: Any, batches: int = 50, warmup: int = 5, cold: bool = False) -> dict[str, Any]:
    """Start-up and train-loader figures of the composed pretraining config `cfg`."""
    from omegaconf import open_dict

    from speechattn.data import DataConfig, PretrainDataModule
    from speechattn.data.datamodules import resolve_root
    from speechattn.tasks.pretrain import PretrainTask, ResumableData
    from speechattn.utils import plain

    if batches < 1 or warmup < 0:
        raise UsageExit(f"--batches must be >= 1 and --warmup >= 0, got {batches}, {warmup}")
    data_cfg = DataConfig(**plain(cfg.data))
    # --cold: an empty feature cache, removed after the run
    scratch = {"prefix": "speechattn-bench-loader-", "ignore_cleanup_errors": True}
    with tempfile.TemporaryDirectory(**scratch) if cold else contextlib.nullcontext() as cache:
        if cold:  # the corpus itself (built-in or given) is resolved first
            data_cfg = replace(data_cfg, root=str(resolve_root(data_cfg)), cache_dir=cache)
        fds_before = open_descriptors()
        wall, cpu, children = time.perf_counter(), cpu_seconds(), finished_children_cpu()
        inner = PretrainDataModule(data_cfg)
        inner.prepare_data()
        inner.setup("fit")
        startup = {
            "wall_s": time.perf_counter() - wall,
            "cpu_s": cpu_seconds() - cpu,
            "children_cpu_s": finished_children_cpu() - children,
            "cold": cold,
        }
        with open_dict(cfg):
            cfg.model.net.feature_dim = int(inner.feature_dim)
        task = PretrainTask(
            model=plain(cfg.model.net),
            masking=plain(cfg.model.masking),
            optimizer=plain(cfg.model.optimizer),
            total_steps=int(cfg.trainer.max_steps),
            seed=int(cfg.seed),
        )
        resumable = ResumableData(inner, seed=int(cfg.seed), batch_masker=task.batch_masker)
        loader = resumable.step_loader(total_batches=1 + warmup + batches)
        timing = _time_loader(loader, warmup, batches)
        summary = inner.describe()
    loading = ("batch_size", "max_frames", "pin_memory", "prefetch_factor", "pad_to_multiple")
    return {
        "benchmark": "loader",
        "train_utterances": summary.get("train_utterances"),
        "val_utterances": summary.get("val_utterances"),
        **{k: getattr(data_cfg, k) for k in loading},
        "num_workers": data_cfg.loader_workers,
        "stack": task.model_config.stack,
        "startup": startup,
        "descriptors_before_setup": fds_before,
        **timing,
    }


def _time_loader(loader: Any, warmup: int, batches: int) -> dict[str, Any]:
    """Iterate `loader`: the first batch (workers start), `warmup` more, then `batches` timed."""
    others = set(child_pids())  # e.g. inductor's compile workers: not the loader's
    start = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - start
    for _ in range(warmup):
        next(iterator)
    workers = [p for p in child_pids() if p not in others]
    cpu_before = cpu_seconds() + sum(cpu_seconds(p) for p in workers)
    frames = padded = 0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        frames += int(batch["lengths"].sum())
        inputs = batch["masked"].inputs  # (B, T', stack * F): padded model frames
        padded += inputs.shape[0] * inputs.shape[1]
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() + sum(cpu_seconds(p) for p in workers) - cpu_before
    descriptors = {"main": open_descriptors(), "workers": [open_descriptors(p) for p in workers]}
    del iterator  # stops the workers
    return {
        "first_batch_s": first,
        "batches": batches,
        "seconds": seconds,
        "frames": frames,
        "frames_per_s": frames / seconds,
        "batches_per_s": batches / seconds,
        "padded_model_frames": padded,
        "cpu_s_per_batch": cpu / batches,
        "descriptors": descriptors,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("loader", __doc__)
    p.add_argument("overrides", nargs="*", help="pretraining config overrides (Hydra)")
    p.add_argument("--batches", type=int, default=50, help="timed batches")
    p.add_argument("--warmup", type=int, default=5, help="untimed batches after the first")
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAKS), help="GPU of the need")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the need")
    p.add_argument("--cold", action="store_true", help="start-up on an empty feature cache")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_intermixed_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from speechattn.config import compose

    check_mfu(args.mfu)
    cfg = compose("pretrain", args.overrides)
    setting, need = project_step(cfg, args.gpu, args.mfu)
    result = {
        "overrides": list(args.overrides),
        **measure(cfg, args.batches, args.warmup, args.cold),
    }
    gpu, peaks = GPU_PEAKS[args.gpu]
    result["need"] = {
        "gpu": gpu,
        "mfu": args.mfu,
        "dtype": setting["dtype"],
        "peak_tflops": peaks[setting["dtype"]] / 1e12,
        **need,
    }
    result["ratio"] = result["frames_per_s"] / need["loader_frames_per_s"]
    r, s, d = result, result["startup"], result["descriptors"]
    valid = r["frames"] / (r["padded_model_frames"] * r["stack"])
    print(
        f"loader for {' '.join(args.overrides) or 'the default config'}: "
        f"{r['train_utterances']} train / {r['val_utterances']} val utterances, batch "
        f"{r['batch_size']}, crop {r['max_frames']}, {r['num_workers']} workers, pin_memory "
        f"{r['pin_memory']}, prefetch {r['prefetch_factor']}, pad to {r['pad_to_multiple']}\n"
        f"  start-up ({'cold: empty feature cache' if s['cold'] else 'cache as found'}): "
        f"{s['wall_s']:.2f} s wall, {s['cpu_s']:.2f} s CPU (+{s['children_cpu_s']:.2f} s in "
        f"extraction workers)\n"
        f"  first batch {r['first_batch_s']:.2f} s; {r['batches']} timed batches in "
        f"{r['seconds']:.2f} s: {r['frames_per_s'] / 1e6:.3f} M frames/s (10 ms), "
        f"{r['batches_per_s']:.1f} batches/s, {100 * valid:.0f} % of padded frames valid, "
        f"{r['cpu_s_per_batch'] * 1e3:.1f} ms CPU per batch (main + workers)\n"
        f"  open descriptors: {d['main']} in the main process (before setup "
        f"{r['descriptors_before_setup']}), workers {d['workers']}\n"
        f"  GPU need (PROJECTION, bench pretrain --plan): {need['step_ms']:.1f} ms per step at "
        f"{args.mfu:.2f} MFU of {gpu} {setting['dtype']} dense peak -> "
        f"{need['loader_frames_per_s'] / 1e6:.3f} M frames/s at full crops\n"
        f"  ratio measured / needed: {r['ratio']:.2f}"
        + ("" if r["ratio"] >= 1 else "  (the GPU would wait for data)")
    )
    write_json(args.json, result)
    return result


def main(argv: list[str]) -> None:
    run(parse(argv))
