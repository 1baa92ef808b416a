"""The error policy (docs/errors.md) at every entry point: an error raised on purpose (a
`SpeechattnError`) ends the command with one line naming the problem and exit status 1; a
traceback only with HYDRA_FULL_ERROR=1 or --debug; anything else is a bug and keeps its
traceback. Every case fails before any training."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from speechattn.data.errors import DataError
from speechattn.errors import ConfigError, SpeechattnError
from speechattn.model.upstream import UpstreamFileError

ROOT = Path(__file__).resolve().parent.parent
HYDRA_QUIET = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
HYDRA_APPS = {"pretrain", "downstream", "analyze", "prune"}

# One of each kind the issue names: a bad input file, a bad setting, a bad upstream file.
ERRORS = {
    "data": DataError("/corpus/19-198-0001.flac", "truncated audio", "12 of 3200 samples"),
    "config": ConfigError("data.batch_size=0: must be >= 1"),
    "upstream": UpstreamFileError("/runs/x/upstream.pt is not a torch file (damaged)"),
}


def _hydra(module: str, work: str) -> tuple[str, str, Callable[[list[str], Path], None]]:
    """(module, the name of its work function, call(argv, tmp_path))."""

    def call(argv: list[str], tmp_path: Path) -> None:
        entry = importlib.import_module(module)
        hydra_args = [f"hydra.run.dir={tmp_path}", *HYDRA_QUIET]
        if module == "speechattn.analyze":
            entry.main(["heads", *argv, *hydra_args])
        else:
            sys.argv = [module, *argv, *hydra_args]
            entry.main()

    return module, work, call


def _argparse(module: str, work: str, argv0: list[str]):
    def call(argv: list[str], tmp_path: Path) -> None:
        importlib.import_module(module).main([*argv0, *argv])

    return module, work, call


def _study():
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        return importlib.import_module("attention_study")
    finally:
        sys.path.remove(str(ROOT / "recipes"))


ENTRY_POINTS = {
    "pretrain": _hydra("speechattn.pretrain", "run"),
    "downstream": _hydra("speechattn.downstream", "run"),
    "analyze": _hydra("speechattn.analyze", "run"),
    "prune": _hydra("speechattn.prune", "run"),
    "report": _argparse("speechattn.report.__main__", "make_report", ["."]),
    "bench": _argparse("speechattn.bench.__main__", "", ["attention"]),
    "cache": _argparse("speechattn.data.cache.__main__", "ls", ["ls"]),
    "export": _argparse("speechattn.export", "write_upstream_folder", ["upstream.pt", "out"]),
    "study": ("attention_study", "run_study", None),
}


def _patch_work(monkeypatch, name: str, error: BaseException) -> Callable[[list[str], Path], None]:
    """The entry point `name` with its work function replaced by one raising `error`."""

    def fail(*args, **kwargs):
        raise error

    module, work, call = ENTRY_POINTS[name]
    if name == "study":
        study = _study()
        monkeypatch.setattr(study, work, fail)
        return lambda argv, tmp_path: study.main(["--out", str(tmp_path), *argv])
    if name == "bench":  # the benchmark module's own main does the work
        monkeypatch.setattr(importlib.import_module("speechattn.bench.attention"), "main", fail)
    else:
        monkeypatch.setattr(importlib.import_module(module), work, fail)
    return call


@pytest.mark.parametrize("kind", sorted(ERRORS))
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_a_speechattn_error_is_one_line_and_exit_1(
    name: str, kind: str, tmp_path: Path, monkeypatch, caplog, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # restored after the Hydra entry points
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    error = ERRORS[kind]
    call = _patch_work(monkeypatch, name, error)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        call([], tmp_path)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    lines += [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # Hydra apps log it, argparse ones print it on stderr
    assert str(error) in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_a_bug_keeps_its_traceback(name: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """Anything that is not a SpeechattnError (here a KeyError from a bug) is not turned into
    a tidy line: the argparse commands let it propagate (Python prints the traceback), and
    Hydra prints it before its own exit status 1."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    call = _patch_work(monkeypatch, name, KeyError("a bug"))
    if name not in HYDRA_APPS:
        with pytest.raises(KeyError, match="a bug"):
            call([], tmp_path)
        return
    with pytest.raises(SystemExit):
        call([], tmp_path)
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err


@pytest.mark.parametrize("name", ["downstream", "report", "study"])
def test_full_error_or_debug_keeps_the_traceback(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    call = _patch_work(monkeypatch, name, ERRORS["data"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(DataError):
        call([], tmp_path)
    if name != "downstream":  # the argparse commands also take --debug
        monkeypatch.delenv("HYDRA_FULL_ERROR")
        with pytest.raises(DataError):
            call(["--debug"], tmp_path)


# ----------------------------------------------------------------------------- real inputs


@pytest.fixture
def random_upstream(tmp_path: Path) -> Path:
    path = tmp_path / "upstream.pt"
    path.write_bytes(os.urandom(4096))
    return path


def _run_hydra(name: str, argv: list[str], tmp_path: Path, monkeypatch, caplog) -> str:
    """Run entry point `name` on `argv`; the one logged error line (asserting exit 1)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    _, _, call = ENTRY_POINTS[name]
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        call(argv, tmp_path / "run")
    assert exited.value.code == 1
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    return lines[0]


def test_real_inputs_at_the_hydra_entry_points(
    tmp_path: Path, random_upstream: Path, monkeypatch, caplog
) -> None:
    """The errors the real jobs raise on purpose, each before any feature or training step."""
    up = str(random_upstream)
    cases = [
        ("downstream", [f"upstream={up}"], "not a torch file"),
        ("downstream", [f"upstream={tmp_path}"], "is a folder, not a file"),
        ("downstream", ["data.batch_size=0"], "data.batch_size=0: must be an integer >= 1"),
        ("analyze", [f"upstream={up}"], "not a torch file"),
        ("analyze", [f"upstream={up}", "num_batches=0"], "num_batches must be >= 1"),
        ("pretrain", [f"ckpt_path={up}"], str(random_upstream)),
        ("prune", [f"heads={tmp_path / 'missing.json'}", "fraction=0.3"], "does not exist"),
    ]
    bad_heads = tmp_path / "heads.json"
    bad_heads.write_text("{not json")
    cases.append(("prune", [f"heads={bad_heads}", "fraction=0.3"], "not a readable heads.json"))
    for name, argv, expected in cases:
        caplog.clear()
        line = _run_hydra(name, argv, tmp_path, monkeypatch, caplog)
        assert expected in line, (name, argv, line)


def test_real_inputs_at_the_argparse_entry_points(tmp_path: Path, capsys) -> None:
    from speechattn.report.__main__ import main as report

    with pytest.raises(SystemExit) as exited:
        report([str(tmp_path / "nowhere")])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results folder" in err[0] and "does not exist" in err[0], err
    study = _study()
    with pytest.raises(SystemExit) as exited:  # a usage error: status 2
        study.main(["--out", str(tmp_path), "--dry-run", "--variants", "nope"])
    assert exited.value.code == 2
    assert "unknown variant(s) ['nope']" in capsys.readouterr().err
    from speechattn.bench.__main__ import main as bench

    with pytest.raises(SystemExit) as exited:
        bench(["nope"])
    assert exited.value.code == 2


@pytest.mark.slow
def test_the_command_line_shows_one_line_and_no_traceback(random_upstream: Path) -> None:
    """As a user sees it (Hydra's own logging, a real process): one error line, status 1;
    with HYDRA_FULL_ERROR=1 the traceback."""
    cmd = [sys.executable, "-m", "speechattn.downstream", f"upstream={random_upstream}",
           f"hydra.run.dir={random_upstream.parent / 'run'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    out = (done.stdout + done.stderr).splitlines()
    errors = [line for line in out if "[ERROR]" in line]
    assert len(errors) == 1 and "not a torch file" in errors[0], out
    assert not any("Traceback" in line for line in out), out
    full = subprocess.run(
        cmd, capture_output=True, text=True, env={**env, "HYDRA_FULL_ERROR": "1"}, timeout=300
    )
    assert full.returncode == 1 and "Traceback" in full.stderr
    assert "UpstreamFileError" in full.stderr


def test_every_error_class_derives_from_the_base() -> None:
    """The classes docs/errors.md lists are all SpeechattnErrors (callers catch one base)."""
    from speechattn.attention.registry import UnknownOptionError
    from speechattn.data.claims import ClaimTimeout
    from speechattn.data.features import LabelMismatchError
    from speechattn.errors import (
        DependencyError,
        DiskFullError,
        MissingFileError,
        OutputExistsError,
    )
    from speechattn.model.serialization import TorchFileError
    from speechattn.model.upstream import ImplausibleWeightsError, NonFiniteWeightsError
    from speechattn.tasks.analysis.heads import NonFiniteMetricError
    from speechattn.tasks.downstream.features import (
        DamagedSplit,
        ImplausibleFeaturesError,
        NonFiniteFeaturesError,
    )
    from speechattn.tasks.downstream.labels.phones import MissingAlignmentsError
    from speechattn.tasks.pretrain import NonFiniteLossError

    classes = [ConfigError, DataError, ClaimTimeout, DependencyError, MissingFileError,
               TorchFileError, UpstreamFileError, NonFiniteWeightsError, NonFiniteLossError,
               NonFiniteMetricError, NonFiniteFeaturesError, DamagedSplit, UnknownOptionError,
               ImplausibleWeightsError, ImplausibleFeaturesError, LabelMismatchError,
               OutputExistsError, DiskFullError, MissingAlignmentsError]  # fmt: skip
    assert all(issubclass(c, SpeechattnError) for c in classes)
    text = (ROOT / "docs" / "errors.md").read_text()
    assert all(f"`{c.__name__}`" in text for c in classes), "docs/errors.md lists every class"


class _ShardError(DataError):
    """A subclass with no pickling code of its own."""


def test_errors_keep_their_type_and_fields_across_processes() -> None:
    """Worker processes send errors back pickled: a subclass arrives as itself, not its base."""
    import pickle

    from speechattn.data.claims import ClaimTimeout
    from speechattn.errors import DiskFullError

    for error in (
        DataError("/x/a.flac", "unreadable audio", "truncated", "a"),
        _ShardError("/cache/s.npy", "damaged shard"),
        ClaimTimeout("/cache/claims", "no progress", "3 shards held"),
        DiskFullError("/out/x.npy: disk full", 28),
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert vars(back) == vars(error)
