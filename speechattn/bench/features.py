"""`python -m speechattn.bench features`: feature extraction and cached-loading throughput.

On the built-in corpus (or `--root`), into a fresh temporary cache (docs/benchmarks.md,
"Feature extraction and loading"); besides extraction and cached loading (raw and as training
batches), the first raw pass over a fresh store (each shard checked as it is opened) and a full
check as `data.verify_cache=true` does at start-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from speechattn.bench.common import parser, time_call, write_json
from speechattn.data.cache import OPEN_SHARDS, ExtractionSettings, FeatureStore, extract_features
from speechattn.data.config import default_cache_root
from speechattn.data.datasets import FeatureDataset, LengthBucketBatchSampler, collate
from speechattn.data.features import Normalizer
from speechattn.data.librispeech import find_splits, scan_split
from speechattn.data.synth import ensure_embedded_corpus

# mel frames/s a tiny AALBERT consumes while training; the quick-start run measured 16.6k (median)
ASSUMED_CONSUMER_FPS = 20_000


def _parse(argv: list[str]) -> argparse.Namespace:
    p = parser("features", __doc__)
    p.add_argument("--root", type=Path, default=None, help="corpus root (default: built-in)")
    p.add_argument("--split", action="append", default=None, help="split folder(s) (default: all)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="extraction processes")
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-seconds", type=float, default=2.0, help="min seconds of each load test")
    p.add_argument("--consumer-fps", type=float, default=ASSUMED_CONSUMER_FPS)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return p.parse_args(argv)


def _rates(fn: Callable[[], None], min_seconds: float, utts: int, frames: int) -> dict:
    """Utterances/s and frames/s of passes of `fn`, repeated after a warm-up for `min_seconds`."""
    fn()  # warm-up: page cache, memory maps, allocator
    passes, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or not passes:
        fn()
        passes += 1
    return {"utt_per_s": utts * passes / elapsed, "frames_per_s": frames * passes / elapsed}


def run(args: argparse.Namespace) -> dict:
    root = args.root or ensure_embedded_corpus(default_cache_root())
    splits = args.split or find_splits(root)
    utts = [u for s in splits for u in scan_split(root, s)]
    settings = ExtractionSettings(dtype=args.dtype)
    results: dict = {
        "root": str(root),
        "splits": splits,
        "utterances": len(utts),
        "workers": args.workers,
    }
    with tempfile.TemporaryDirectory(prefix="speechattn-bench-") as cache:
        start = time.perf_counter()
        store = extract_features(
            utts, settings, cache, workers=args.workers, shard_size=args.shard_size, progress=False
        )
        extract_s, audio_s = time.perf_counter() - start, store.audio_seconds
        frames = int(store.lengths.sum())
        results["extraction"] = {
            "audio_seconds": audio_s,
            "wall_seconds": extract_s,
            "x_real_time": audio_s / extract_s,
            "frames": frames,
            "cache_mb": store.nbytes() / 2**20,
        }
        # new object, shard files closed: opened (and checked) on first use
        for k in range(store.num_shards):
            OPEN_SHARDS.forget(str(store.paths(k).npy))
        fresh = FeatureStore(store.manifest)
        n = len(fresh)

        def raw_pass() -> None:
            for i in range(n):
                fresh.features(i)

        first = time_call(raw_pass, "cpu")
        results["load_first_pass"] = {"seconds": first, "frames_per_s": frames / first}
        start = time.perf_counter()
        if damaged := fresh.check(verify=True):
            raise RuntimeError(f"the cache just written does not verify: {damaged[:3]}")
        results["verify_all_seconds"] = time.perf_counter() - start
        results["load_raw"] = _rates(raw_pass, args.min_seconds, n, frames)
        dataset = FeatureDataset(fresh, range(n), Normalizer.from_sums(*fresh.sums(range(n))))
        sampler = LengthBucketBatchSampler(
            range(n), args.batch_size, False, dataset.lengths, shuffle=True
        )
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)

        def batch_pass() -> None:
            for _ in loader:
                pass

        results["load_batches"] = _rates(batch_pass, args.min_seconds, n, frames)
    results["assumed_consumer_fps"] = args.consumer_fps
    results["load_vs_consumer"] = results["load_batches"]["frames_per_s"] / args.consumer_fps
    return results


def _print(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    e, first = r["extraction"], r["load_first_pass"]
    minutes = e["audio_seconds"] / 60
    title = f"features benchmark: {r['utterances']} utterances, {minutes:.1f} min of audio"
    table = Table("measurement", "throughput", "detail", title=title)
    for row in (
        (
            f"extraction ({r['workers']} workers)",
            f"{e['x_real_time']:.0f}x real time",
            f"{e['wall_seconds']:.2f} s wall, {e['frames']:,} frames, cache {e['cache_mb']:.1f} MB",
        ),
        (
            "cached load, first pass",
            f"{first['frames_per_s']:,.0f} frames/s",
            f"{first['seconds']:.3f} s; checking every file (data.verify_cache): "
            f"{r['verify_all_seconds']:.3f} s",
        ),
        *(
            (
                name,
                f"{r[k]['frames_per_s']:,.0f} frames/s",
                f"{r[k]['utt_per_s']:,.0f} utterances/s",
            )
            for k, name in (
                ("load_raw", "cached load, raw slices"),
                ("load_batches", "cached load, training batches"),
            )
        ),
        (
            "load / assumed consumer",
            f"{r['load_vs_consumer']:.0f}x",
            f"assumes a tiny model trains at {r['assumed_consumer_fps']:,.0f} mel frames/s "
            "(not measured)",
        ),
    ):
        table.add_row(*row)
    Console().print(table)
    print(
        f"torch threads {torch.get_num_threads()}, cpu count {os.cpu_count()}; targets: "
        "extraction >= 300x real time, load >= 20x consumer"
    )


def main(argv: list[str] | None = None) -> None:
    args = _parse(list(argv or []))
    results = run(args)
    _print(results)
    write_json(args.json, results)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
