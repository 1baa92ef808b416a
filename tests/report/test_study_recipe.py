"""recipes/attention_study.py: every registered variant, resumable skips, scale switch, and
the study run through Hydra's submitit launcher (each job a local process)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from speechattn.attention import available

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "attention_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("attention_study", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_covers_every_variant_and_task(study, tmp_path: Path, capsys) -> None:
    args = ["--scale", "tiny", "--out", str(tmp_path), "--dry-run", "--no-bench", "--jobs", "1"]
    assert study.main(args) == 0
    out = capsys.readouterr().out
    every = ",".join(available())
    tasks = "task=speaker_utterance,speaker_frame,phone_1hidden,phone_2hidden"
    # one multirun per stage, a job per variant (and per task)
    assert out.count("speechattn.pretrain --multirun") == 1
    assert f"speechattn.pretrain --multirun attention={every} " in out
    assert f"speechattn.downstream --multirun +variant={every} {tasks} " in out
    assert f"speechattn.downstream --multirun +variant=mel {tasks} upstream=mel " in out
    assert f"'upstream={tmp_path}/pretrain/${{variant}}/upstream.pt'" in out
    assert f"speechattn.analyze --multirun +variant={every} analysis=heads 'upstream=" in out
    assert "downstream=" not in out  # tiny: the head analysis of the pretraining loss only
    assert "hydra/launcher" not in out  # Hydra's basic launcher: no SLURM, no submitit
    assert "speechattn.report" in out


def test_basic_launcher_splits_each_stage_over_the_cores(study, tmp_path: Path, capsys) -> None:
    """Tiny scale, basic launcher: one single-threaded multirun per core, each a share of the
    variants, together all of them exactly once."""
    study.os.cpu_count = lambda: 2  # restored below: the module is shared by the tests
    try:
        args = ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--heads", ""]
        assert study.main(args) == 0
    finally:
        study.os.cpu_count = os.cpu_count
    lines = capsys.readouterr().out.splitlines()
    for stage, key in (("pretrain", "attention="), ("downstream", "+variant=")):
        runs = [line for line in lines if f"speechattn.{stage} --multirun" in line]
        assert [r.split(":")[0] for r in runs] == [f"[study] {stage}-1", f"[study] {stage}-2"]
        shares = [r.split(key)[1].split()[0].split(",") for r in runs]
        assert sorted(shares[0] + shares[1]) == sorted(available())
        assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_launcher_and_its_settings_reach_every_multirun(study, tmp_path: Path, capsys) -> None:
    args = ["--out", str(tmp_path / "a,b"), "--dry-run", "--no-bench", "--variants", "full"]
    args += ["--launcher", "slurm", "--launcher-arg", "hydra.launcher.partition=gpu"]
    args += ["--pretrain-arg", "hydra.launcher.timeout_min=4320", "--heads", "phone_1hidden"]
    assert study.main(args) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if "--multirun" in line]
    # pretrain, mel, downstream, ABX of mel and of the variants, heads: SLURM runs the jobs
    # side by side
    assert len(runs) == 6
    abx = next(r for r in runs if "speechattn.abx --multirun +variant=full" in r)
    assert f"{tmp_path}/a,b/pretrain/${{variant}}/upstream.pt" in abx
    for run in runs:
        assert "hydra/launcher=slurm hydra.launcher.partition=gpu" in run
    assert runs[0].endswith("hydra.launcher.timeout_min=4320")  # the stage's own wins: last
    assert "timeout_min" not in " ".join(runs[1:])
    # --out with a comma: quoted, so Hydra reads one path, not a sweep over two
    assert f"""'hydra.sweep.dir='"'"'{tmp_path}/a,b/pretrain'"'"''""" in runs[0]


@pytest.mark.parametrize("text", ["/data/a,b/out", "/it's here/${variant}/x", "/plain/${v}"])
def test_paths_reach_hydra_unchanged(study, text: str) -> None:
    override = OverridesParser.create().parse_override(f"key={study.hydra_value(text)}")
    assert not override.is_sweep_override() and override.value() == text


def test_finished_work_is_skipped(study, tmp_path: Path, capsys) -> None:
    (tmp_path / "pretrain" / "full").mkdir(parents=True)
    (tmp_path / "pretrain" / "full" / "upstream.pt").write_bytes(b"x")
    for task in ("speaker_utterance", "phone_1hidden"):
        (tmp_path / "downstream" / "full" / task).mkdir(parents=True)
        (tmp_path / "downstream" / "full" / task / "result.json").write_text("{}")
    study.main(
        ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--variants", "full"]
    )
    out = capsys.readouterr().out
    assert "pretrain full: done, skipping" in out
    assert "speechattn.pretrain" not in out  # nothing left to pretrain: no multirun
    assert "+variant=full task=speaker_frame,phone_2hidden " in out


def test_paper_scale_needs_librispeech(study, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("LIBRISPEECH", raising=False)
    with pytest.raises(SystemExit, match="LibriSpeech root"):
        study.main(["--scale", "paper", "--out", str(tmp_path), "--dry-run"])
    scale = study.scale_overrides("paper", "/data/LibriSpeech")
    assert (
        "experiment=paper" in scale.pretrain and "data.root=/data/LibriSpeech" in scale.downstream
    )


def test_unknown_variant_or_task_is_refused(study, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        study.main(["--out", str(tmp_path), "--dry-run", "--variants", "nope"])
    with pytest.raises(SystemExit, match=r"unknown task\(s\) \['phone'\]; choose from speaker_"):
        study.main(["--out", str(tmp_path), "--dry-run", "--tasks", "phone_1hidden,phone"])


def test_parallel_jobs_share_the_cores_and_failures_are_recorded(
    study, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(study.os, "cpu_count", lambda: 4)
    runner = study.Study(tmp_path, study.Scale(jobs=2))
    show = "import os; print('threads', os.environ['OMP_NUM_THREADS'])"
    assert runner.command("show", [sys.executable, "-c", show])
    assert "threads 2" in (tmp_path / "logs" / "show.log").read_text()
    assert not runner.command("quiet", [sys.executable, "-c", "raise SystemExit(4)"], False)
    assert not runner.command("loud", [sys.executable, "-c", "raise SystemExit(3)"])
    assert runner.failures == [f"loud: exit 3, log {tmp_path / 'logs' / 'loud.log'}"]


def test_jobs_must_be_positive(study, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--jobs must be at least 1, got 0"):
        study.main(["--out", str(tmp_path), "--dry-run", "--jobs", "0"])


def test_head_analyses_per_variant(study, tmp_path: Path, capsys) -> None:
    args = ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--variants", "ldsa"]
    args += ["--heads", "pretrain,phone_1hidden"]
    assert study.main(args) == 0
    out = capsys.readouterr().out
    heads = f"hydra.sweep.dir={tmp_path / 'heads'}"
    assert f"'upstream={tmp_path}/pretrain/${{variant}}/upstream.pt' {heads}" in out
    assert "'hydra.sweep.subdir=${variant}/pretrain'" in out
    assert f"'downstream={tmp_path}/downstream/${{variant}}/phone_1hidden' {heads}" in out
    assert "'hydra.sweep.subdir=${variant}/phone_1hidden'" in out
    assert study.main([*args, "--heads", ""]) == 0
    assert "speechattn.analyze" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown head analysis"):
        study.main([*args, "--heads", "pretrain,nope"])


@pytest.mark.slow
def test_study_through_submitit_local_resumes_and_reports_failures(
    study, tmp_path: Path, tiny_corpus: Path, tiny_feature_cache: Path, capsys
) -> None:
    """Two tiny variants through `hydra/launcher=local` (submitit: every job its own process).
    ldsa's upstream.pt is damaged at first: its probe and its ABX fail, are reported and the
    exit status is 1 while full's jobs finish; rerun after removing it (and with the head
    analyses), only ldsa's pretraining, probe and ABX run, and full's result is left as it
    was."""
    out = tmp_path / "study"
    data = [
        f"data.root={tiny_corpus}",
        f"data.cache_dir={tiny_feature_cache}",
        "data.batch_size=4",
        "data.extract_workers=1",
        "data.shard_size=8",
        "data.progress=false",
    ]
    shrink = ["model.net.dim=32", "model.net.num_layers=2", "model.net.num_heads=4"]
    shrink += ["model.net.ffn_dim=64", "model.net.conv_position_groups=4"]
    steps = ["trainer.max_steps=2", "trainer.val_check_interval=2", "progress_bar=none"]
    args = ["--out", str(out), "--variants", "full,ldsa", "--tasks", "phone_1hidden"]
    args += ["--no-mel", "--no-bench", "--launcher", "local"]
    args += [f"--pretrain-arg={a}" for a in [*data, *shrink, *steps, "logger=none"]]
    args += [f"--downstream-arg={a}" for a in [*data, "trainer.max_epochs=1"]]
    args += [f"--abx-arg={a}" for a in data]
    heads = ["--heads-arg=num_batches=2", "--heads"]
    damaged = out / "pretrain" / "ldsa" / "upstream.pt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a checkpoint")

    assert study.main([*args, *heads, ""]) == 1  # (the head analyses in the rerun only)
    printed = capsys.readouterr()
    assert "pretrain ldsa: done, skipping" in printed.out
    first_pretrain = (out / "logs" / "pretrain.log").read_text().splitlines()[0]
    assert " attention=full " in first_pretrain and "hydra/launcher=local" in first_pretrain
    assert list((out / "pretrain" / ".submitit").glob("*/*_log.out"))  # run by submitit
    full_result = out / "downstream" / "full" / "phone_1hidden" / "result.json"
    assert (out / "pretrain" / "full" / "upstream.pt").is_file() and full_result.is_file()
    assert "[study] failed: downstream ldsa phone_1hidden: no result.json" in printed.err
    assert "[study] failed: abx ldsa: no abx.json" in printed.err
    assert printed.err.count("[study] failed:") == 2
    assert (out / "abx" / "full" / "abx.json").is_file()
    assert (out / "README.md").is_file()  # the report of what there is

    damaged.unlink()
    before = full_result.stat().st_mtime_ns
    assert study.main([*args, *heads, "pretrain"]) == 0
    printed = capsys.readouterr()
    assert "pretrain full: done, skipping" in printed.out and "[study] failed" not in printed.err
    for log in ("pretrain", "downstream", "abx"):
        command = (out / "logs" / f"{log}.log").read_text().splitlines()[0]
        assert " attention=ldsa " in command or " +variant=ldsa " in command
    assert (out / "downstream" / "ldsa" / "phone_1hidden" / "result.json").is_file()
    assert full_result.stat().st_mtime_ns == before
    for variant in ("full", "ldsa"):
        assert (out / "heads" / variant / "pretrain" / "heads.json").is_file()


@pytest.mark.parametrize("elsewhere", [True, False])
def test_multiruns_that_only_wait_run_at_once(study, tmp_path: Path, elsewhere: bool) -> None:
    """With local or slurm a multirun waits for jobs that run elsewhere, so mel's probes and the
    variants' are submitted together; with the basic launcher, `scale.jobs` (1) at a time."""
    import threading

    runner = study.Study(tmp_path, study.Scale(jobs=1), jobs_elsewhere=elsewhere)
    # side by side, the second arrives at once: a generous timeout costs nothing, where a
    # tight one would break the barrier when a loaded machine starts the second thread late;
    # one at a time, the first waits out the timeout alone
    both_running = threading.Barrier(2, timeout=60 if elsewhere else 2)

    def command(name: str, argv: list[str], record_failure: bool = True) -> bool:
        try:
            both_running.wait()
        except threading.BrokenBarrierError:
            return False
        return True

    runner.command = command
    sweeps = [study.Sweep(n, "speechattn.downstream", "+variant", [n], []) for n in ("mel", "full")]
    logs = runner.run_sweeps(sweeps, [])
    assert logs == {("mel", "mel"): "mel", ("full", "full"): "full"}
    assert both_running.broken is not elsewhere


def test_each_missing_output_names_the_multirun_that_ran_it(study, tmp_path: Path) -> None:
    """Multiruns that write nothing: every job is reported missing with its job folder and the
    log of the multirun (share) that ran it, though a variant is in several multiruns."""
    runner = study.Study(tmp_path, study.Scale(jobs=2))
    runner.command = lambda name, argv, record_failure=True: True
    for variant in ("full", "linear"):  # their phone_1hidden probes exist, ldsa's failed
        result = tmp_path / "downstream" / variant / "phone_1hidden" / "result.json"
        result.parent.mkdir(parents=True)
        result.write_text("{}")
    runner.heads(["full", "ldsa", "linear"], ("pretrain", "phone_1hidden"))

    def failure(variant: str, analysis: str, log: str) -> str:
        job = tmp_path / "heads" / variant / analysis
        return f"heads {variant} {analysis}: no heads.json (job log {job}/, multirun log {tmp_path / 'logs' / log}.log)"

    assert sorted(runner.failures) == sorted(
        [
            failure("full", "pretrain", "heads_pretrain-1"),
            failure("linear", "pretrain", "heads_pretrain-1"),  # round robin: full, linear | ldsa
            failure("ldsa", "pretrain", "heads_pretrain-2"),
            failure("full", "phone_1hidden", "heads_phone_1hidden-1"),
            failure("linear", "phone_1hidden", "heads_phone_1hidden-2"),
        ]
    )


def test_superb_tasks_per_variant_and_baseline(study, tmp_path: Path, capsys) -> None:
    done = tmp_path / "superb" / "speech_commands" / "fbank_no_cmvn"
    done.mkdir(parents=True)
    (done / "superb_result.json").write_text("{}")
    args = ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--heads", "",
            "--variants", "full,ldsa", "--superb", "ks,pr"]  # fmt: skip
    study.main(args)
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if "-m speechattn.superb" in line]
    assert len(runs) == 2 * (3 * 2 - 1)  # train + evaluate; (2 variants + fbank) x 2 tasks - done
    up = tmp_path / "pretrain" / "ldsa" / "upstream.pt"
    want = f"-u speechattn -k {up} -d ctc -p {tmp_path}/superb/ctc/ldsa --quick -m evaluate"
    assert any(line.endswith(want) for line in runs), runs
    assert not any("speech_commands -p" in r and "fbank_no_cmvn -m" in r for r in runs)
    with pytest.raises(SystemExit, match="unknown SUPERB task"):
        study.main(["--out", str(tmp_path), "--dry-run", "--superb", "asr"])
