"""The attention study end to end: pretrain every variant, probe it on the four tasks, report.

    python recipes/attention_study.py --scale tiny                  # built-in corpus, CPU
    python recipes/attention_study.py --scale paper --librispeech /data/LibriSpeech \\
        --launcher slurm --launcher-arg hydra.launcher.partition=gpu   # a SLURM job per run

(`recipes/attention_study.sh` wraps this; docs/slurm.md has the SLURM side.) Every stage is a
Hydra multirun of an entry point, run by the launcher `--launcher` names (`hydra/launcher=`):
`basic`, Hydra's own, runs the jobs one after another in the multirun's process; `local`
(conf/hydra/launcher/local.yaml) runs each job in its own local process, all at once; `slurm`
(conf/hydra/launcher/slurm.yaml) submits each job to SLURM with one GPU. The stages, and the
output folder they fill:

    OUT/pretrain/<variant>/upstream.pt          python -m speechattn.pretrain -m attention=a,b,...
    OUT/downstream/<variant>/<task>/result.json python -m speechattn.downstream -m +variant=a,b,...
                                                task=t1,t2,... (upstream OUT/pretrain/<variant>)
    OUT/downstream/mel/<task>/result.json       the no-pretraining baseline (upstream=mel)
    OUT/abx/<variant>/abx.json                  python -m speechattn.abx -m +variant=a,b,... (every
                                                layer, no training; and mel)
    OUT/heads/<variant>/<analysis>/heads.json   python -m speechattn.analyze -m analysis=heads
                                                +variant=a,b,... (pretraining loss, and the
                                                phone_1hidden probe by default)
    OUT/bench/attention.json                   python -m speechattn.bench attention --json
    OUT/superb/<task>/<unit>/superb_result.json with --superb ks,sid,pr: python -m speechattn.superb
                                                train + evaluate per variant and for the
                                                fbank_no_cmvn baseline (--quick at tiny scale;
                                                run here, one after another, not by the launcher)
    OUT/cache/                                 frozen features (shared by the four tasks)
    OUT/logs/<stage>.log                       each multirun's own output (the job logs are in
                                               the job folders, and .submitit/ for local/slurm)
    OUT/README.md, table*.md/csv, fig_*.png    python -m speechattn.report OUT

(`+variant=NAME` adds a key that only names the job's folder and its upstream.) Resumable: a
variant with an `upstream.pt` is not pretrained again (an interrupted pretraining resumes from
its last checkpoint), and a task with a `result.json` or an analysis with a `heads.json` is not
run again: each multirun gets only the missing jobs, so rerunning the same command continues an
interrupted study. A failed job is reported (with its logs) and what depends on it is skipped;
the report shows the gap and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from speechattn.errors import ConfigError, add_debug_flag, command_line_errors, usage_error
from speechattn.tasks.records import ABX_FILE, MEL, RESULT_FILE, TASKS

LAUNCHERS = ("basic", "local", "slurm")  # hydra/launcher options (conf/hydra/launcher/)
HEADS_FILE = "heads.json"
# --superb abbreviations -> s3prl downstream names (speechattn.superb.configs.ABBREVIATION)
SUPERB_TASKS = {"ks": "speech_commands", "sid": "voxceleb1", "pr": "ctc"}
SUPERB_BASELINE = "fbank_no_cmvn"  # the fair baseline: no per-utterance normalisation


def hydra_value(text: str | Path) -> str:
    """`text` as the value of a Hydra override: quoted where it holds characters the override
    grammar reads (a comma would make a sweep of `--out /data/a,b`); `${...}` still resolves."""
    text = str(text)
    if re.fullmatch(r"[\w/.~+:@${}-]*", text):
        return text
    return "'" + text.replace("'", "\\'") + "'"


@dataclass
class Scale:
    """Hydra overrides per stage for one scale of the study."""

    pretrain: list[str] = field(default_factory=list)
    downstream: list[str] = field(default_factory=list)
    abx: list[str] = field(default_factory=list)
    bench: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    analyses: tuple[str, ...] = ("pretrain", "phone_1hidden")  # head analyses per variant
    # multiruns side by side, each given a share of a stage's jobs (the basic launcher runs a
    # multirun's jobs one after another; local and slurm run them side by side themselves)
    jobs: int = 1


def scale_overrides(scale: str, librispeech: str | None, launcher: str = "basic") -> Scale:
    if scale == "tiny":
        # Built-in corpus, experiment=tiny, CPU: the quick-start run (800 steps of 8 utterances)
        # for every variant; 14 pretrainings, 60 probes and the head analyses took 71 min on
        # 2 cores.
        return Scale(
            pretrain=["experiment=tiny", "trainer.accelerator=cpu", "trainer.max_steps=800"],
            downstream=["trainer.accelerator=cpu", "device=cpu"],
            abx=["device=cpu"],
            bench=["--quick", "--device", "cpu"],
            heads=["device=cpu", "num_batches=4"],
            analyses=("pretrain",),
            # A tiny model keeps one core busy at best: one single-threaded multirun per core.
            jobs=(os.cpu_count() or 1) if launcher == "basic" else 1,
        )
    if scale == "paper":
        if not librispeech:
            raise ConfigError(
                "--scale paper needs the LibriSpeech root: --librispeech DIR or $LIBRISPEECH"
            )
        data = ["data=librispeech", f"data.root={librispeech}"]
        return Scale(
            pretrain=["experiment=paper", *data],
            downstream=[*data, "trainer.max_epochs=100", "early_stopping.patience=10"],
            abx=data,
            bench=[],
        )
    raise ConfigError(f"unknown scale {scale!r}: tiny or paper")


@dataclass
class Sweep:
    """One Hydra multirun, a job per value of `key` (times the values the overrides sweep):
    `python -m MODULE --multirun KEY=V1,V2,... OVERRIDES...`."""

    name: str  # its log: OUT/logs/<name>.log
    module: str  # the entry point, e.g. speechattn.pretrain
    key: str  # e.g. attention, +variant
    values: list[str]
    overrides: list[str]

    def argv(self, extra: list[str]) -> list[str]:
        values = f"{self.key}={','.join(self.values)}"
        return [sys.executable, "-m", self.module, "--multirun", values, *self.overrides, *extra]

    def split(self, parts: int) -> list[Sweep]:
        """At most `parts` multiruns sharing the values (round robin), named NAME-1, NAME-2..."""
        parts = min(parts, len(self.values))
        if parts <= 1:
            return [self]
        return [
            Sweep(
                f"{self.name}-{i + 1}", self.module, self.key, self.values[i::parts], self.overrides
            )
            for i in range(parts)
        ]


class Study:
    """The study's output folder: which work is missing, the multiruns that do it, and the
    failures left after them."""

    def __init__(
        self,
        out: Path,
        scale: Scale,
        launcher: list[str] | None = None,
        dry_run: bool = False,
        jobs_elsewhere: bool = False,
    ) -> None:
        self.out, self.scale, self.dry_run = out, scale, dry_run
        self.launcher = list(launcher or [])  # overrides for every multirun: hydra/launcher=...
        # the launcher runs the jobs in processes of their own (local, slurm): a multirun only
        # waits for them, so all of a stage's multiruns run at once (mel's probes beside the
        # variants' on the cluster), not scale.jobs at a time
        self.jobs_elsewhere = jobs_elsewhere
        self.failures: list[str] = []
        self.env = dict(os.environ)
        if scale.jobs > 1:  # share the cores between the multiruns instead of oversubscribing them
            threads = str(max(1, (os.cpu_count() or 1) // scale.jobs))
            self.env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        (out / "logs").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ paths of the outputs

    def upstream_path(self, variant: str) -> Path:
        return self.out / "pretrain" / variant / "upstream.pt"

    def result_path(self, unit: str, task: str) -> Path:
        return self.out / "downstream" / unit / task / RESULT_FILE

    def abx_path(self, unit: str) -> Path:
        return self.out / "abx" / unit / ABX_FILE

    def heads_path(self, variant: str, analysis: str) -> Path:
        return self.out / "heads" / variant / analysis / HEADS_FILE

    # ------------------------------------------------------------------ running

    def log_path(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"

    def command(self, name: str, argv: list[str], record_failure: bool = True) -> bool:
        """Run one command, its output to logs/<name>.log; True on success."""
        log = self.log_path(name)
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

    def run_sweeps(self, sweeps: list[Sweep], extra: Sequence[str]) -> dict[tuple[str, str], str]:
        """Run the multiruns, `scale.jobs` side by side (all at once when their jobs run
        elsewhere); returns the log name of the multirun that ran each (sweep name, value) (a
        failed job is found by its missing output, not by the multirun's exit status)."""
        split = {sweep.name: sweep.split(self.scale.jobs) for sweep in sweeps}
        parts = [part for shares in split.values() for part in shares]
        if not parts:
            return {}
        # the stage's own overrides last: they win over --launcher-arg (e.g. a longer time limit)
        argv = [(part.name, part.argv([*self.launcher, *extra]), False) for part in parts]
        side_by_side = len(parts) if self.jobs_elsewhere else self.scale.jobs
        with ThreadPoolExecutor(max_workers=side_by_side) as pool:
            list(pool.map(lambda a: self.command(*a), argv))  # list() re-raises an exception here
        return {
            (name, value): part.name
            for name, shares in split.items()
            for part in shares
            for value in part.values
        }

    def missing(self, what: str, path: Path, job_dir: Path, sweep: str) -> None:
        """Record a job whose output is missing after its multirun, with where to look."""
        self.failures.append(
            f"{what}: no {path.name} (job log {job_dir}/, multirun log {self.log_path(sweep)})"
        )

    # ------------------------------------------------------------------ stages

    def pretrain(self, variants: list[str], extra: Sequence[str] = ()) -> list[str]:
        """Pretrain the variants without an upstream.pt; returns the variants that have one."""
        todo = []
        for variant in variants:
            if self.upstream_path(variant).is_file():
                print(f"[study] pretrain {variant}: done, skipping ({self.upstream_path(variant)})")
            else:
                todo.append(variant)
        sweep = Sweep(
            "pretrain",
            "speechattn.pretrain",
            "attention",
            todo,
            [
                f"hydra.sweep.dir={hydra_value(self.out / 'pretrain')}",
                "hydra.sweep.subdir=${attention.name}",
                "ckpt_path=last",  # resume an interrupted pretraining from its last checkpoint
                *self.scale.pretrain,
            ],
        )
        logs = self.run_sweeps([sweep] if todo else [], extra)
        if self.dry_run:
            return variants
        for variant in todo:
            if not self.upstream_path(variant).is_file():
                path = self.upstream_path(variant)
                self.missing(f"pretrain {variant}", path, path.parent, logs["pretrain", variant])
        return [v for v in variants if self.upstream_path(v).is_file()]

    def downstream(
        self, units: list[str], tasks: tuple[str, ...], extra: Sequence[str] = ()
    ) -> None:
        """Probe each unit (a pretrained variant or `mel`) on its tasks without a result.json:
        one multirun per set of missing tasks (Hydra sweeps products: variants x tasks)."""
        groups: dict[tuple[bool, tuple[str, ...]], list[str]] = defaultdict(list)
        for unit in units:
            todo = tuple(t for t in tasks if not self.result_path(unit, t).is_file())
            if todo:
                groups[(unit == MEL, todo)].append(unit)
            else:
                print(f"[study] downstream {unit}: all tasks done, skipping", flush=True)
        sweeps: list[Sweep] = []
        todos: list[tuple[str, ...]] = []  # the tasks of each sweep
        for (is_mel, todo), group in groups.items():
            upstream = MEL if is_mel else f"{self.out / 'pretrain'}/${{variant}}/upstream.pt"
            others = sum(s.name != "downstream_mel" for s in sweeps)
            name = "downstream_mel" if is_mel else f"downstream{f'_{others + 1}' if others else ''}"
            todos.append(todo)
            sweeps.append(
                Sweep(
                    name,
                    "speechattn.downstream",
                    "+variant",
                    group,
                    [
                        f"task={','.join(todo)}",
                        f"upstream={hydra_value(upstream)}",
                        f"hydra.sweep.dir={hydra_value(self.out / 'downstream')}",
                        "hydra.sweep.subdir=${variant}/${task.name}",
                        f"cache_dir={hydra_value(self.out / 'cache')}",
                        *self.scale.downstream,
                    ],
                )
            )
        logs = self.run_sweeps(sweeps, extra)
        if self.dry_run:
            return
        for sweep, todo in zip(sweeps, todos):
            for unit in sweep.values:
                for task in todo:
                    path = self.result_path(unit, task)
                    if not path.is_file():
                        log = logs[sweep.name, unit]
                        self.missing(f"downstream {unit} {task}", path, path.parent, log)

    def abx(self, units: list[str], extra: Sequence[str] = ()) -> None:
        """ABX of every layer of each unit (a pretrained variant or `mel`) without an abx.json:
        one multirun for the variants, one for `mel` (no training: a minute or so each on the
        built-in corpus)."""
        todo = [u for u in units if not self.abx_path(u).is_file()]
        sweeps = []
        for name, group in (("abx_mel", [u for u in todo if u == MEL]),
                            ("abx", [u for u in todo if u != MEL])):  # fmt: skip
            upstream = (
                MEL if name == "abx_mel" else f"{self.out / 'pretrain'}/${{variant}}/upstream.pt"
            )
            if group:
                sweeps.append(Sweep(name, "speechattn.abx", "+variant", group, [
                    f"upstream={hydra_value(upstream)}",
                    f"hydra.sweep.dir={hydra_value(self.out / 'abx')}",
                    "hydra.sweep.subdir=${variant}", *self.scale.abx,
                ]))  # fmt: skip
        logs = self.run_sweeps(sweeps, extra)
        for sweep in [] if self.dry_run else sweeps:
            for unit in sweep.values:
                if not (path := self.abx_path(unit)).is_file():
                    self.missing(f"abx {unit}", path, path.parent, logs[sweep.name, unit])

    def heads(
        self, variants: list[str], analyses: tuple[str, ...], extra: Sequence[str] = ()
    ) -> None:
        """Head importance, ablation and pruning (python -m speechattn.analyze heads) of each
        pretrained variant: for its pretraining loss (`pretrain`) and/or a trained probe (a
        task, skipped where that probe failed: already reported). One multirun per analysis."""
        sweeps = []
        for analysis in analyses:
            todo = [v for v in variants if not self.heads_path(v, analysis).is_file()]
            if analysis == "pretrain":
                source = f"upstream={hydra_value(f'{self.out}/pretrain/${{variant}}/upstream.pt')}"
            else:
                if not self.dry_run:
                    todo = [v for v in todo if self.result_path(v, analysis).is_file()]
                source = (
                    f"downstream={hydra_value(f'{self.out}/downstream/${{variant}}/{analysis}')}"
                )
            if todo:
                sweeps.append(
                    Sweep(
                        f"heads_{analysis}",
                        "speechattn.analyze",
                        "+variant",
                        todo,
                        [
                            "analysis=heads",
                            source,
                            f"hydra.sweep.dir={hydra_value(self.out / 'heads')}",
                            f"hydra.sweep.subdir=${{variant}}/{analysis}",
                            "progress=false",
                            *self.scale.heads,
                        ],
                    )
                )
        logs = self.run_sweeps(sweeps, extra)
        if self.dry_run:
            return
        for sweep in sweeps:
            analysis = sweep.name.removeprefix("heads_")
            for variant in sweep.values:
                path = self.heads_path(variant, analysis)
                if not path.is_file():
                    log = logs[sweep.name, variant]
                    self.missing(f"heads {variant} {analysis}", path, path.parent, log)

    def bench(self) -> None:
        """The attention benchmark, run here (not through the launcher: it is no Hydra app)."""
        path = self.out / "bench" / "attention.json"
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "speechattn.bench", "attention", "--json", str(path)]
        self.command("bench_attention", [*argv, *self.scale.bench])

    def superb(self, variants: list[str], tasks: Sequence[str], quick: bool) -> None:
        """SUPERB tasks through s3prl's runner (python -m speechattn.superb), each pretrained
        variant and the fair baseline fbank_no_cmvn; a task with a superb_result.json is done."""
        units = [(v, ["-u", "speechattn", "-k", str(self.upstream_path(v))]) for v in variants]
        units.append((SUPERB_BASELINE, ["-u", SUPERB_BASELINE]))
        for abbreviation in tasks:
            task = SUPERB_TASKS[abbreviation]
            for unit, upstream in units:
                expdir = self.out / "superb" / task / unit
                if (expdir / "superb_result.json").is_file():
                    continue
                argv = [sys.executable, "-m", "speechattn.superb", *upstream, "-d", task,
                        "-p", str(expdir), *(["--quick"] if quick else [])]  # fmt: skip
                name = f"superb_{abbreviation}_{unit}"
                if self.command(f"{name}_train", [*argv, "-m", "train"]):
                    self.command(f"{name}_evaluate", [*argv, "-m", "evaluate"])

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
    parser.add_argument("--no-abx", action="store_true", help="skip ABX of every layer")
    parser.add_argument(
        "--heads",
        default=None,
        help="head analyses per variant: pretrain (its pretraining loss) and/or task names "
        "(that probe's loss and accuracy); empty for none (default: tiny pretrain, paper "
        "pretrain,phone_1hidden)",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="basic",
        help="Hydra launcher of every multirun (hydra/launcher=...): basic runs the jobs one "
        "after another here, local each in its own process here, slurm each as a SLURM job "
        "(docs/slurm.md)",
    )
    parser.add_argument(
        "--launcher-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every multirun (repeatable), e.g. "
        "hydra.launcher.partition=gpu",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="multiruns side by side, each with a share of a stage's jobs and of the cores "
        "(default: tiny with the basic launcher one per core, else 1)",
    )
    parser.add_argument(
        "--superb",
        default="",
        help="SUPERB tasks through s3prl's runner per variant and for fbank_no_cmvn, "
        "comma-separated from ks,sid,pr (docs/superb.md; needs the s3prl extra); --quick "
        "configs at tiny scale",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--pretrain-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for the pretrainings (repeatable), e.g. "
        "trainer.max_steps=300, hydra.launcher.timeout_min=4320",
    )
    parser.add_argument(
        "--downstream-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for the downstream runs (repeatable), e.g. layer=weighted",
    )
    parser.add_argument(
        "--abx-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for the ABX runs (repeatable), e.g. split=dev",
    )
    parser.add_argument(
        "--heads-arg",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for the head analyses (repeatable), e.g. num_batches=8",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with command_line_errors(args.debug, parser.prog):
        return run_study(parser, args)


def run_study(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The study as `args` asks (main's work once the command line is parsed)."""
    from speechattn.attention import available

    variants = available()
    if args.variants:
        chosen = args.variants.split(",")
        unknown = sorted(set(chosen) - set(variants))
        if unknown:
            usage_error(parser, f"unknown variant(s) {unknown}; available: {', '.join(variants)}")
        variants = [v for v in variants if v in chosen]
    tasks = tuple(args.tasks.split(","))
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        usage_error(parser, f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    superb = tuple(t for t in args.superb.split(",") if t)
    unknown = sorted(set(superb) - set(SUPERB_TASKS))
    if unknown:
        usage_error(parser, f"unknown SUPERB task(s) {unknown}; choose from ks, sid, pr")
    out = (args.out or Path("results") / args.scale).resolve()
    try:
        scale = scale_overrides(args.scale, args.librispeech, args.launcher)
    except ConfigError as e:
        usage_error(parser, str(e))
    if args.jobs is not None:
        if args.jobs < 1:
            usage_error(parser, f"--jobs must be at least 1, got {args.jobs}")
        scale.jobs = args.jobs
    analyses = (
        scale.analyses if args.heads is None else tuple(a for a in args.heads.split(",") if a)
    )
    unknown = sorted(set(analyses) - {"pretrain", *TASKS})
    if unknown:
        usage_error(parser, f"unknown head analysis {unknown}; choose pretrain or tasks {TASKS}")

    launcher = [] if args.launcher == "basic" else [f"hydra/launcher={args.launcher}"]
    elsewhere = args.launcher != "basic"
    study = Study(out, scale, [*launcher, *args.launcher_arg], args.dry_run, elsewhere)
    side_by_side = "a stage's multiruns at once" if elsewhere else f"up to {scale.jobs} at once"
    print(
        f"[study] {args.scale}: {len(variants)} variants x {len(tasks)} tasks, launcher "
        f"{args.launcher} ({side_by_side}) -> {out}"
    )
    start = time.perf_counter()
    pretrained = study.pretrain(variants, args.pretrain_arg)
    units = ([] if args.no_mel else [MEL]) + pretrained
    study.downstream(units, tasks, args.downstream_arg)
    if not args.no_abx:
        study.abx(units, args.abx_arg)
    study.heads(pretrained, analyses, args.heads_arg)
    if superb:
        study.superb(pretrained, superb, quick=args.scale == "tiny")
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
