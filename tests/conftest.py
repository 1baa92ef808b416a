"""Shared fixtures: a tiny built-in corpus and a ready `DataConfig` pointing at it.

- Every test session gets its own cache folder (`SPEECHATTN_CACHE` is redirected), so no test
  reads or writes `~/.cache/speechattn`.
- `tiny_corpus` (session): Path of a 4-speaker x 6-utterance corpus (~1.5 min of speech) in
  the built-in layout (`synth-clean/`, `converted_aligned_phones.txt`, split lists, ...),
  synthesised once per session (~2 s).
- `crafted_torch_file` (function): writes a torch file whose unpickling would run a shell
  command that creates a marker file; tests load it through a code path and check the marker
  never appears (a checkpoint must never run code).
- `gpu_device` (function): the device of the `gpu` suite (`pytest -m gpu`): CUDA, skipping
  without it; `SPEECHATTN_GPU_SUITE_DEVICE=cpu` runs the suite on CPU to check the suite itself.
- `one_torch_thread` (function): torch (and so the compiled CPU kernels) on one thread for
  the test: tiny tensors gain nothing from threads, and the suite then compiles only the
  kernels' serial builds (their threaded builds, about 17 s to compile, are tested in the slow
  tier).
- `tiny_data_config` (function): `DataConfig` for that corpus -- batch size 4, no workers, no
  progress bars, a session-wide feature cache (features are extracted once per session; keys are
  content hashes, so sharing is safe). Tests may `dataclasses.replace` it; use `tmp_path` as
  `cache_dir` when a test needs a cold cache.

    def test_something(tiny_data_config):
        dm = LabelledDataModule(tiny_data_config)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from speechattn.data import DataConfig
from speechattn.data.synth import build_corpus

TINY_SPEAKERS, TINY_UTTERANCES = 4, 6


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point `SPEECHATTN_CACHE` at a per-session temporary folder."""
    previous = os.environ.get("SPEECHATTN_CACHE")
    path = tmp_path_factory.mktemp("speechattn-cache")
    os.environ["SPEECHATTN_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("SPEECHATTN_CACHE", None)
    else:
        os.environ["SPEECHATTN_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Root of a small built-in corpus (4 speakers x 6 utterances, split folder `synth-clean`)."""
    root = tmp_path_factory.mktemp("tiny-corpus")
    return build_corpus(
        root, speakers=TINY_SPEAKERS, utterances_per_speaker=TINY_UTTERANCES, seed=0, workers=1
    )


@pytest.fixture(scope="session")
def tiny_feature_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-wide feature cache folder used by `tiny_data_config`."""
    return tmp_path_factory.mktemp("tiny-feature-cache")


@pytest.fixture
def tiny_data_config(tiny_corpus: Path, tiny_feature_cache: Path) -> DataConfig:
    """A `DataConfig` for `tiny_corpus`, small batches, CPU-friendly, quiet."""
    return DataConfig(
        corpus="embedded",
        root=str(tiny_corpus),
        cache_dir=str(tiny_feature_cache),
        batch_size=4,
        num_workers=0,
        extract_workers=1,
        shard_size=8,
        progress=False,
    )


PRETRAIN_STEPS = 6


@pytest.fixture(scope="session")
def pretrained_tiny_run(
    tiny_corpus: Path, tiny_feature_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Run folder of a real `python -m speechattn.pretrain` run (through `run(cfg)`) on
    `tiny_corpus`: the tiny preset shrunk to D 32, 2 layers, `PRETRAIN_STEPS` steps; holds
    `upstream.pt`, `README.md` (model card), `metrics.csv` and the loss curve."""
    from speechattn.config import compose
    from speechattn.pretrain import run

    out = tmp_path_factory.mktemp("pretrained-tiny")
    overrides = [
        f"data.root={tiny_corpus}",
        f"data.cache_dir={tiny_feature_cache}",
        "data.batch_size=4",
        "data.extract_workers=1",
        "data.shard_size=8",
        "data.progress=false",
        "model.net.dim=32",
        "model.net.num_layers=2",
        "model.net.num_heads=4",
        "model.net.ffn_dim=64",
        "model.net.conv_position_groups=4",
        f"trainer.max_steps={PRETRAIN_STEPS}",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1",
        "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=100",
        "progress_bar=none",
        "logger=none",
        f"output_dir={out}",
    ]
    run(compose("pretrain", overrides))
    return out


class _RunsShell:
    """Unpickles by calling `os.system(command)`: what a malicious checkpoint would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


@pytest.fixture
def crafted_torch_file(tmp_path: Path) -> Callable[..., Path]:
    """`write(path, contents=None) -> marker`: save `contents` (a dict, e.g. a real checkpoint)
    plus a payload that would `touch marker` when unpickled without `weights_only`."""

    def write(path: Path, contents: dict[str, Any] | None = None) -> Path:
        marker = tmp_path / f"ran-{path.name}.marker"
        torch.save({**(contents or {}), "payload": _RunsShell(f"touch {marker}")}, path)
        # the payload is live: an unrestricted load would call os.system
        assert any(
            "system" in g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path)
        )
        return marker

    return write


@pytest.fixture
def gpu_device() -> torch.device:
    """CUDA for the `gpu` suite; skips without it, unless SPEECHATTN_GPU_SUITE_DEVICE=cpu asks
    to run the suite on CPU (slowly: it checks the tests, not the GPU)."""
    if os.environ.get("SPEECHATTN_GPU_SUITE_DEVICE") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, the previous count restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist workers share the cores: one torch thread each, or two workers on two cores
    # would run four threads that wait for each other
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
