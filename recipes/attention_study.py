"""The attention study end to end: pretrain every variant, probe it on the four tasks, report.

    python recipes/attention_study.py --scale tiny                  # built-in corpus, CPU
    python recipes/attention_study.py --scale paper --librispeech /data/LibriSpeech   # GPU

(`recipes/attention_study.sh` wraps this.) Layout of the output folder:

    OUT/pretrain/<variant>/upstream.pt         python -m speechattn.pretrain attention=<variant>
    OUT/downstream/<variant>/<task>/result.json python -m speechattn.downstream (Hydra multirun)
    OUT/downstream/mel/<task>/result.json       the no-pretraining baseline
    OUT/heads/<variant>/<analysis>/heads.json   python -m speechattn.analyze heads (pretraining
                                               loss, and the phone_1hidden probe by default)
    OUT/bench/attention.json                   python -m speechattn.bench attention --json
    OUT/cache/                                 frozen features (shared by the four tasks)
    OUT/logs/*.log                             every command's output
    OUT/README.md, table*.md/csv, fig_*.png    python -m speechattn.report OUT

Resumable: a variant with an `upstream.pt` is not pretrained again, and a task with a
`result.json` or an analysis with a `heads.json` is not run again, so rerunning the same command continues an interrupted study.
A failing step is logged and skipped; the report shows the gap and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from speechattn.tasks.records import MEL, TASKS


@dataclass
class Scale:
    """Hydra overrides per stage for one scale of the study."""

    pretrain: list[str] = field(default_factory=list)
    downstream: list[str] = field(default_factory=list)
    bench: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    analyses: tuple[str, ...] = ("pretrain", "phone_1hidden")  # head analyses per variant
    jobs: int = 1  # variants run side by side (each a pretraining then its four probes)


def scale_overrides(scale: str, librispeech: str | None) -> Scale:
    if scale == "tiny":
        # Built-in corpus, experiment=tiny, CPU: the quick-start run (800 steps of 8 utterances)
        # for every variant; 14 pretrainings, 60 probes and the head analyses took 71 min on
        # 2 cores.
        return Scale(
            pretrain=["experiment=tiny", "trainer.accelerator=cpu", "trainer.max_steps=800"],
            downstream=["trainer.accelerator=cpu", "device=cpu"],
            bench=["--quick", "--device", "cpu"],
            heads=["device=cpu", "num_batches=4"],
            analyses=("pretrain",),
            # A tiny model keeps one core busy at best: run one single-threaded job per core.
            jobs=os.cpu_count() or 1,
        )
    if scale == "paper":
        if not librispeech:
            raise SystemExit(
                "--scale paper needs the LibriSpeech root: --librispeech DIR or $LIBRISPEECH"
            )
        data = ["data=librispeech", f"data.root={librispeech}"]
        return Scale(
            pretrain=["experiment=paper", *data],
            downstream=[*data, "trainer.max_epochs=100", "early_stopping.patience=10"],
            bench=[],
        )
    raise SystemExit(f"unknown scale {scale!r}: tiny or paper")


class Study:
    def __init__(self, out: Path, scale: Scale, dry_run: bool = False) -> None:
        self.out, self.scale, self.dry_run = out, scale, dry_run
        self.failures: list[str] = []  # appended from worker threads (list.append is atomic)
        self.env = dict(os.environ)
        if scale.jobs > 1:  # share the cores between the jobs instead of oversubscribing them
            threads = str(max(1, (os.cpu_count() or 1) // scale.jobs))
            self.env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def command(self, name: str, argv: list[str], record_failure: bool = True) -> bool:
        """Run one step, its output to logs/<name>.log; True on success."""
        log = self.out / "logs" / f"{name}.log"
        line = " ".join(shlex.quote(a) for a in argv)
        print(f"[study] {name}: {line}", flush=True)
        if self.dry_run:
            return True
        start = time.perf_counter()
        with open(log, "w") as f:
            f.write(f"$ {line}\n")
            f.flush()
            code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env)
        elapsed = time.perf_counter() - start
        status = "ok" if code == 0 else f"FAILED (exit {code}, see {log})"
        print(f"[study] {name}: {status} in {elapsed:.0f} s", flush=True)
        if code != 0 and record_failure:
            self.failures.append(f"{name}: exit {code}, log {log}")
        return code == 0

    def upstream_path(self, variant: str) -> Path:
        return self.out / "pretrain" / variant / "upstream.pt"

    def pretrain(self, variant: str) -> bool:
        path = self.upstream_path(variant)
        if path.is_file():
            print(f"[study] pretrain {variant}: done, skipping ({path})", flush=True)
            return True
        argv = [
            sys.executable,
            "-m",
            "speechattn.pretrain",
            f"attention={variant}",
            f"hydra.run.dir={path.parent}",
            "ckpt_path=last",  # resume an interrupted pretraining from its last checkpoint
            *self.scale.pretrain,
        ]
        ok = self.command(f"pretrain_{variant}", argv)
        if ok and not self.dry_run and not path.is_file():
            self.failures.append(f"pretrain {variant}: finished without writing {path}")
            return False
        return ok

    def downstream(self, variant: str, tasks: tuple[str, ...]) -> None:
        folder = self.out / "downstream" / variant
        todo = [t for t in tasks if not (folder / t / "result.json").is_file()]
        if not todo:
            print(f"[study] downstream {variant}: all tasks done, skipping", flush=True)
            return
        upstream = MEL if variant == MEL else str(self.upstream_path(variant))
        argv = [
            sys.executable,
            "-m",
            "speechattn.downstream",
            "--multirun",
            f"task={','.join(todo)}",
            f"upstream={upstream}",
            f"hydra.sweep.dir={folder}",
            "hydra.sweep.subdir=${task.name}",
            f"cache_dir={self.out / 'cache'}",
            *self.scale.downstream,
        ]
        if self.command(f"downstream_{variant}", argv, record_failure=False) or self.dry_run:
            return
        # A failing job stops a Hydra multirun: give every task still missing its own run.
        for task in [t for t in todo if not (folder / t / "result.json").is_file()]:
            single = [a if not a.startswith("task=") else f"task={task}" for a in argv]
            single = [a for a in single if a != "--multirun"]
            single = [
                f"hydra.run.dir={folder / task}" if a.startswith("hydra.sweep.dir") else a
                for a in single
                if not a.startswith("hydra.sweep.subdir")
            ]
            self.command(f"downstream_{variant}_{task}", single)

    def heads(self, variant: str, analyses: tuple[str, ...]) -> None:
        """Head importance, ablation and pruning (python -m speechattn.analyze heads) of one
        pretrained variant: for its pretraining loss (`pretrain`) and/or a trained probe (a task).
        """
        for analysis in analyses:
            folder = self.out / "heads" / variant / analysis
            if (folder / "heads.json").is_file():
                continue
            if analysis == "pretrain":
                source = [f"upstream={self.upstream_path(variant)}"]
            else:
                probe = self.out / "downstream" / variant / analysis
                if not (probe / "result.json").is_file() and not self.dry_run:
                    continue  # the probe failed: already reported
                source = [f"downstream={probe}"]
            argv = [
                sys.executable,
                "-m",
                "speechattn.analyze",
                "heads",
                *source,
                f"hydra.run.dir={folder}",
                "progress=false",
                *self.scale.heads,
            ]
            self.command(f"heads_{variant}_{analysis}", argv)

    def bench(self) -> None:
        path = self.out / "bench" / "attention.json"
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "speechattn.bench", "attention", "--json", str(path)]
        self.command("bench_attention", [*argv, *self.scale.bench])

    def report(self) -> None:
        self.command("report", [sys.executable, "-m", "speechattn.report", str(self.out)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", choices=("tiny", "paper"), default="tiny")
    parser.add_argument("--out", type=Path, default=None, help="default: results/<scale>")
    parser.add_argument(
        "--librispeech",
        default=os.environ.get("LIBRISPEECH"),
        help="LibriSpeech root for --scale paper (default: $LIBRISPEECH)",
    )
    parser.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset")
    parser.add_argument("--no-mel", action="store_true", help="skip the mel baseline")
    parser.add_argument("--no-bench", action="store_true", help="skip the attention benchmark")
    parser.add_argument(
        "--heads",
        default=None,
        help="head analyses per variant: pretrain (its pretraining loss) and/or task names "
        "(that probe's loss and accuracy); empty for none (default: tiny pretrain, paper "
        "pretrain,phone_1hidden)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="variants run in parallel, cores shared between them (default: tiny one per core, "
        "paper 1)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--pretrain-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every pretraining (repeatable), e.g. trainer.max_steps=300",
    )
    parser.add_argument(
        "--downstream-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every downstream run (repeatable), e.g. layer=weighted",
    )
    args = parser.parse_args(argv)

    from speechattn.attention import available

    variants = available()
    if args.variants:
        chosen = args.variants.split(",")
        unknown = sorted(set(chosen) - set(variants))
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; available: {', '.join(variants)}")
        variants = [v for v in variants if v in chosen]
    tasks = tuple(args.tasks.split(","))
    out = (args.out or Path("results") / args.scale).resolve()
    scale = scale_overrides(args.scale, args.librispeech)
    scale.pretrain += args.pretrain_arg
    scale.downstream += args.downstream_arg
    if args.jobs is not None:
        if args.jobs < 1:
            raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
        scale.jobs = args.jobs
    study = Study(out, scale, args.dry_run)
    print(
        f"[study] {args.scale}: {len(variants)} variants x {len(tasks)} tasks, "
        f"{scale.jobs} in parallel -> {out}"
    )

    analyses = (
        scale.analyses if args.heads is None else tuple(a for a in args.heads.split(",") if a)
    )
    unknown = sorted(set(analyses) - {"pretrain", *TASKS})
    if unknown:
        raise SystemExit(f"unknown head analysis {unknown}; choose pretrain or tasks {TASKS}")

    def evaluate(variant: str) -> None:
        if variant == MEL:
            study.downstream(variant, tasks)
        elif study.pretrain(variant):
            study.downstream(variant, tasks)
            study.heads(variant, analyses)

    start = time.perf_counter()
    units = ([] if args.no_mel else [MEL]) + variants
    with ThreadPoolExecutor(max_workers=scale.jobs) as pool:
        list(pool.map(evaluate, units))  # list() re-raises a worker's exception here
    if not args.no_bench:
        study.bench()
    study.report()
    print(
        f"[study] finished in {(time.perf_counter() - start) / 60:.1f} min; report: {out}/README.md"
    )
    for failure in study.failures:
        print(f"[study] failed: {failure}", file=sys.stderr)
    return 1 if study.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
