"""How start-up and the train loader grow with the corpus: generated corpora of 1k / 10k / 100k
utterances, each measured cold (empty feature cache) then warm, in fresh processes.

For each size: `bench corpus` writes (or reuses) DIR/corpus-<n>, DIR/cache-<n> is emptied,
then `bench loader experiment=paper OVERRIDES data.root=... data.cache_dir=...` runs twice:
cold (the start-up extracts every feature), then warm (what every later run and DDP rank pays).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from speechattn.bench.common import parser, write_json
from speechattn.bench.corpus import add_seconds_argument, make_scale_corpus

SPLIT = "train-clean-360"


def loader_run(overrides: list[str], batches: int, warmup: int) -> dict[str, Any]:
    """`python -m speechattn.bench loader OVERRIDES` in a new process; its --json result."""
    with tempfile.TemporaryDirectory(prefix="speechattn-scale-") as tmp:
        out = Path(tmp) / "loader.json"
        cmd = [
            sys.executable,
            "-m",
            "speechattn.bench",
            "loader",
            *overrides,
            "--batches",
            str(batches),
            "--warmup",
            str(warmup),
            "--json",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def measure_size(
    work: Path, size: int, overrides: list[str], batches: int, warmup: int, seconds: list[float]
) -> dict[str, Any]:
    """Corpus build, cold and warm runs of `bench loader` for a corpus of `size` utterances."""
    start = time.perf_counter()
    root = make_scale_corpus(work / f"corpus-{size}", size, split=SPLIT, seconds=seconds)
    built = time.perf_counter() - start
    cache = work / f"cache-{size}"
    shutil.rmtree(cache, ignore_errors=True)  # cold: nothing extracted yet
    data = [
        f"data.root={root}",
        f"data.cache_dir={cache}",
        f"data.pretrain_splits=[{SPLIT}]",
        "data.progress=false",
    ]
    every = ["experiment=paper", *overrides, *data]
    cold = loader_run(every, batches, warmup)
    warm = loader_run(every, batches, warmup)
    workers = [n for n in warm["descriptors"]["workers"] if n is not None]
    return {
        "utterances": size,
        "corpus_s": built,
        "cold_wall_s": cold["startup"]["wall_s"],
        "cold_cpu_s": cold["startup"]["cpu_s"] + cold["startup"]["children_cpu_s"],
        "warm_wall_s": warm["startup"]["wall_s"],
        "warm_cpu_s": warm["startup"]["cpu_s"] + warm["startup"]["children_cpu_s"],
        "frames_per_s": warm["frames_per_s"],
        "cpu_ms_per_batch": warm["cpu_s_per_batch"] * 1e3,
        "num_workers": warm["num_workers"],
        "descriptors_main": warm["descriptors"]["main"],
        "descriptors_worker_max": max(workers, default=None),
        "need_frames_per_s": warm["need"]["loader_frames_per_s"],
        "cold": cold,
        "warm": warm,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("scale", __doc__)
    p.add_argument("overrides", nargs="*", help="pretraining overrides after experiment=paper")
    p.add_argument("--work", type=Path, required=True, help="corpora and caches go here (kept)")
    p.add_argument("--sizes", default="1000,10000,100000", help="utterances, comma-separated")
    p.add_argument("--batches", type=int, default=50, help="timed loader batches per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed loader batches per run")
    add_seconds_argument(p, "durations of the corpus's source files, comma-separated")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        f"scale: sizes {sizes}, sources {args.seconds} s, {os.cpu_count()} CPUs, work folder "
        f"{args.work}; experiment=paper {' '.join(args.overrides)}"
    )
    print(
        f"  {'utterances':>10s} {'corpus s':>8s} {'cold s':>7s} {'cold CPU':>8s} "
        f"{'warm s':>7s} {'warm CPU':>8s} {'M frames/s':>10s} {'CPU ms/b':>8s} "
        f"{'fds main/worker':>15s}"
    )
    rows = []
    for size in sizes:
        r = measure_size(args.work, size, args.overrides, args.batches, args.warmup, args.seconds)
        rows.append(r)
        print(
            f"  {size:10d} {r['corpus_s']:8.1f} {r['cold_wall_s']:7.1f} {r['cold_cpu_s']:8.1f} "
            f"{r['warm_wall_s']:7.2f} {r['warm_cpu_s']:8.2f} {r['frames_per_s'] / 1e6:10.3f} "
            f"{r['cpu_ms_per_batch']:8.1f} "
            f"{r['descriptors_main']!s:>7s}/{r['descriptors_worker_max']!s:<7s}",
            flush=True,
        )
    if rows:
        need = rows[-1]["need_frames_per_s"]
        print(f"  GPU need (projection, bench loader): {need / 1e6:.3f} M frames/s")
    write_json(args.json, {"benchmark": "scale", "rows": rows})
