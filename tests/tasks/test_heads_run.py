"""`python -m speechattn.analyze heads`: run(cfg) end to end, heads.json schema, input errors."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from speechattn.analyze import compose_config, main, run
from speechattn.data.features import Normalizer
from speechattn.model import aalbert
from speechattn.model.upstream import save_upstream, upstream_state
from speechattn.tasks.analysis.sources import HeadsRunConfig, recorded_data_config
from speechattn.tasks.downstream import DownstreamProbe, TaskConfig
from speechattn.tasks.downstream.features import file_sha256
from speechattn.tasks.records import KIND, DownstreamResult, read_heads

F, D, LAYERS, HEADS, SPEAKERS = 8, 16, 2, 4, 3


def make_upstream(
    path: Path, attention: str = "full", feature_dim: int = F, data_config: dict | None = None
) -> Path:
    torch.manual_seed(0)
    model = aalbert(
        feature_dim=feature_dim,
        dim=D,
        num_layers=LAYERS,
        num_heads=HEADS,
        ffn_dim=32,
        dropout=0.0,
        attention=attention,
    )
    metadata = {"masking": {"fraction": 0.3, "span": 3}, "data_config": data_config or {}}
    norm = Normalizer(torch.zeros(feature_dim), torch.ones(feature_dim))
    state = upstream_state(model, norm, {}, metadata)
    return save_upstream(path, state)


class TinyData:
    """The data-module surface the analysis uses: setup, val/test/extraction loaders,
    normalizer, num_speakers. Batches follow the data contract."""

    def __init__(self, n: int = 6, batch_size: int = 3) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            T = int(torch.randint(15, 40, (), generator=g))
            self.items.append((f"utt{i}", torch.randn(T, F, generator=g), i % SPEAKERS))
        self.batch_size = batch_size
        self.normalizer = SimpleNamespace(mean=torch.zeros(F), std=torch.ones(F))
        self.num_speakers = SPEAKERS
        self.feature_dim = F

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        pass

    def _batches(self) -> list[dict]:
        out = []
        for s in range(0, len(self.items), self.batch_size):
            items = self.items[s : s + self.batch_size]
            lengths = torch.tensor([x.shape[0] for _, x, _ in items])
            T = int(lengths.max())
            features = torch.zeros(len(items), T, F)
            for b, (_, x, _) in enumerate(items):
                features[b, : x.shape[0]] = x
            out.append(
                {
                    "features": features,
                    "lengths": lengths,
                    "padding_mask": torch.arange(T)[None] >= lengths[:, None],
                    "utt_ids": [u for u, _, _ in items],
                    "speaker": torch.tensor([s for _, _, s in items]),
                }
            )
        return out

    def val_dataloader(self) -> list[dict]:
        return self._batches()

    def extraction_dataloader(self, split: str) -> list[dict]:
        return self._batches()


def compose_analyze(out: Path, *overrides: str) -> DictConfig:
    return compose_config([f"output_dir={out}", "progress=false", "figures=false", *overrides])


def make_downstream_run(
    directory: Path,
    upstream: Path,
    layers=(LAYERS,),
    task: TaskConfig | None = None,
    num_classes: int = SPEAKERS,
    corpus: dict | None = None,
) -> Path:
    """A finished `python -m speechattn.downstream` run dir: result.json + best checkpoint."""
    task = task or TaskConfig(name="speaker_utterance", target="speaker", level="utterance")
    torch.manual_seed(3)
    probe = DownstreamProbe(task, D, len(layers), num_classes, 3, 2)
    trainer = L.Trainer(
        max_epochs=0, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.strategy.connect(probe)
    (directory / "checkpoints").mkdir(parents=True)
    trainer.save_checkpoint(directory / "checkpoints" / "best-epoch=0.ckpt", weights_only=True)
    DownstreamResult(
        task=task.name,
        upstream=str(upstream),
        upstream_sha256=file_sha256(upstream),
        attention="full",
        layer="last",
        dev_accuracy=0.5,
        test_accuracy=0.4,
        seed=0,
        code_version="test",
        split_sizes={"train": 6, "dev": 6, "test": 6},
        probe={"layers": list(layers)},
        corpus=corpus or {},
        best_epoch=0,
    ).write(directory)
    return directory


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("attention", ["full", "ldsa", "syn_fixed"])
def test_pretrain_run_writes_heads_json(tmp_path: Path, attention: str) -> None:
    upstream = make_upstream(tmp_path / "upstream.pt", attention)
    out = tmp_path / "analysis"
    figures = "figures=true" if attention == "full" else "figures=false"
    cfg = compose_analyze(out, f"upstream={upstream}", "num_batches=1", figures)
    result = run(cfg, datamodule=TinyData())

    data = read_heads(out / "heads.json")
    assert data == json.loads((out / "heads.json").read_text())
    assert {k: result[k] for k in data} == data
    assert data["kind"] == KIND and data["schema_version"] == 1
    assert data["task"] == "pretrain" and data["metric"] == "l1_loss"
    assert data["higher_is_better"] is False
    assert data["attention"] == attention and data["num_layers"] == LAYERS
    assert data["num_heads"] == HEADS
    assert data["upstream"] == str(upstream.resolve())
    assert data["upstream_sha256"] == file_sha256(upstream)
    assert data["downstream"] is None and data["split"] == "val"
    assert data["subset"]["batches"] == 1 and data["subset"]["utterances"] == 3
    assert data["importance"]["per"] == "utterance" and len(data["importance"]["order"]) == 8
    for row in data["importance"]["normalized"]:
        assert sum(v * v for v in row) == pytest.approx(1.0)
    for key in ("single", "keep_only"):
        assert len(data["ablation"][key]["delta"]) == LAYERS
    assert len(data["ablation"]["layer"]["metric"]) == LAYERS
    points = data["pruning"]["points"]
    assert points[0]["metric"] == data["base_metric"] and points[0]["num_masked"] == 0
    assert points[-1]["fraction"] == 1.0
    assert all(v == 0 for row in points[-1]["mask"] for v in row)
    assert data["seed"] == 0 and data["code_version"]
    assert set(data["runtime_s"]) >= {"load", "importance", "ablation", "pruning", "total"}
    if attention == "full":
        names = sorted(Path(p).name for p in result["figures"])
        assert names == ["heads_ablation.png", "heads_importance.png", "heads_pruning.png"]
        assert all(Path(p).stat().st_size > 1000 for p in result["figures"])


def test_options_reach_the_analysis(tmp_path: Path) -> None:
    upstream = make_upstream(tmp_path / "upstream.pt")
    cfg = compose_analyze(
        tmp_path / "a",
        f"upstream={upstream}",
        "importance.per=batch",
        "ablation.keep_only=false",
        "pruning.step=0.25",
        "pruning.keep_one_per_layer=true",
        "pruning.recompute=true",
        "seed=5",
    )
    data = run(cfg, datamodule=TinyData())
    assert data["importance"]["per"] == "batch" and data["subset"]["importance_units"] == 2
    assert data["ablation"]["keep_only"] is None and data["seed"] == 5
    assert data["pruning"]["recompute"] and data["pruning"]["keep_one_per_layer"]
    assert [p["num_masked"] for p in data["pruning"]["points"]] == [0, 2, 4, 6]
    assert all(sum(row) == 1 for row in data["pruning"]["points"][-1]["mask"])


def test_downstream_run_uses_the_probe_and_its_task(tmp_path: Path) -> None:
    upstream = make_upstream(tmp_path / "upstream.pt")
    run_dir = make_downstream_run(tmp_path / "ds", upstream, layers=(0, 1, 2))
    cfg = compose_analyze(tmp_path / "a", f"downstream={run_dir}", "pruning.step=0.5")
    data = run(cfg, datamodule=TinyData())  # upstream taken from result.json
    assert data["task"] == "speaker_utterance" and data["metric"] == "accuracy"
    assert data["higher_is_better"] is True and 0.0 <= data["base_metric"] <= 1.0
    assert data["downstream"]["dir"] == str(run_dir.resolve())
    assert data["downstream"]["checkpoint"].endswith("best-epoch=0.ckpt")
    assert data["downstream"]["layers"] == [0, 1, 2] and data["split"] == "dev"
    assert data["subset"]["scored"] == 6
    assert [p["num_masked"] for p in data["pruning"]["points"]] == [0, 4, 8]


def test_pretrain_and_phone_probe_on_the_tiny_corpus(tmp_path: Path, tiny_data_config) -> None:
    """The real data modules, built from the data config recorded with the upstream / result."""
    from speechattn.data import LabelledDataModule

    data = asdict(tiny_data_config)
    upstream = make_upstream(tmp_path / "upstream.pt", "ldsa", feature_dim=80, data_config=data)
    common = ["num_batches=1", "ablation.keep_only=false", "pruning.step=0.5"]
    pre = run(compose_analyze(tmp_path / "pre", f"upstream={upstream}", *common))
    assert pre["task"] == "pretrain" and pre["subset"]["utterances"] >= 1
    assert pre["subset"]["scored"] > 0

    labelled = LabelledDataModule(tiny_data_config)
    labelled.setup("fit")
    task = TaskConfig(
        name="phone_1hidden", target="phones", level="frame", hidden_layers=1, hidden_dim=8
    )
    corpus = {"corpus": "embedded", "test_utterances": 4, "config": data}  # as downstream writes
    run_dir = make_downstream_run(
        tmp_path / "ds", upstream, task=task, num_classes=labelled.num_phones, corpus=corpus
    )
    res = run(compose_analyze(tmp_path / "a", f"downstream={run_dir}", "split=test", *common))
    assert res["task"] == "phone_1hidden" and res["metric"] == "accuracy"
    assert res["split"] == "test" and res["subset"]["utterances"] == 4
    assert res["subset"]["scored"] > 100  # 10 ms phone labels
    assert 0.0 <= res["base_metric"] <= 1.0


def test_recorded_data_config_reads_both_result_layouts() -> None:
    config = {"corpus": "embedded", "batch_size": 4}
    assert recorded_data_config({"corpus": "embedded", "root": "/x", "config": config}) == config
    assert recorded_data_config(config) == config
    assert recorded_data_config(None) == {}


# ----------------------------------------------------------------------------- errors


def test_unknown_task_lists_the_tasks(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigCompositionException, match=r"(?s)task/speaker_id.*phone_1hidden.*pretrain"
    ):
        compose_analyze(tmp_path, "upstream=x.pt", "task=speaker_id")
    assert compose_analyze(tmp_path, "task=pretrain").task.name == "pretrain"
    assert compose_analyze(tmp_path, "task=speaker_frame").task.name == "speaker_frame"
    with pytest.raises(ValueError, match="pretrain, speaker_utterance, speaker_frame"):
        HeadsRunConfig(task="speaker_id")


def test_downstream_task_without_run_dir_says_what_is_needed(tmp_path: Path) -> None:
    cfg = compose_analyze(tmp_path, "upstream=x.pt", "task=phone_1hidden")
    with pytest.raises(ValueError, match=r"downstream=RESULT_DIR.*result.json.*best-epoch"):
        run(cfg)


def test_bad_downstream_dirs_name_the_file_needed(tmp_path: Path) -> None:
    upstream = make_upstream(tmp_path / "upstream.pt")
    cfg = compose_analyze(tmp_path / "a", f"downstream={tmp_path / 'nope'}")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        run(cfg, datamodule=TinyData())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no result.json"):
        run(compose_analyze(tmp_path / "a", f"downstream={empty}"), datamodule=TinyData())
    run_dir = make_downstream_run(tmp_path / "ds", upstream)
    (run_dir / "checkpoints" / "best-epoch=0.ckpt").unlink()
    with pytest.raises(FileNotFoundError, match=r"checkpoints/best-epoch=N.ckpt"):
        run(compose_analyze(tmp_path / "a", f"downstream={run_dir}"), datamodule=TinyData())
    (run_dir / "checkpoints" / "best-epoch=0.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="best-epoch=0.ckpt: not a readable downstream probe"):
        run(compose_analyze(tmp_path / "a", f"downstream={run_dir}"), datamodule=TinyData())


def test_downstream_task_and_upstream_must_match_the_run(tmp_path: Path) -> None:
    upstream = make_upstream(tmp_path / "upstream.pt")
    other = make_upstream(tmp_path / "other.pt", "ldsa")
    run_dir = make_downstream_run(tmp_path / "ds", upstream)
    cfg = compose_analyze(tmp_path / "a", f"downstream={run_dir}", "task=speaker_frame")
    with pytest.raises(ValueError, match="is a speaker_utterance run"):
        run(cfg, datamodule=TinyData())
    cfg = compose_analyze(tmp_path / "a", f"downstream={run_dir}", f"upstream={other}")
    with pytest.raises(ValueError, match="not the upstream the probe"):
        run(cfg, datamodule=TinyData())


def test_upstream_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="upstream=PATH is required"):
        run(compose_analyze(tmp_path), datamodule=TinyData())
    with pytest.raises(FileNotFoundError, match="missing.pt does not exist"):
        run(compose_analyze(tmp_path, f"upstream={tmp_path / 'missing.pt'}"))
    with pytest.raises(ValueError, match="upstream=mel has no attention heads"):
        run(compose_analyze(tmp_path, "upstream=mel"))
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match="foreign.pt is not a speechattn upstream"):
        run(compose_analyze(tmp_path, f"upstream={foreign}"), datamodule=TinyData())
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="garbage.pt is not a readable speechattn upstream"):
        run(compose_analyze(tmp_path, f"upstream={garbage}"), datamodule=TinyData())


def test_cli_needs_a_known_analysis(capsys: pytest.CaptureFixture[str]) -> None:
    """The analysis is the `analysis` group: none or an unknown one fails, listing `heads`."""
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 1 and "analysis" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["attention_maps", "upstream=x"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "analysis/attention_maps" in err and "heads" in err


def test_crafted_probe_or_upstream_never_runs_code(tmp_path: Path, crafted_torch_file) -> None:
    """Head analysis reads files we may not have written (a shared run dir): the probe
    checkpoint and the upstream are refused, naming them, and their pickle never runs."""
    upstream = make_upstream(tmp_path / "upstream.pt")
    run_dir = make_downstream_run(tmp_path / "ds", upstream)
    best = run_dir / "checkpoints" / "best-epoch=0.ckpt"
    marker = crafted_torch_file(best, torch.load(best, weights_only=True))
    with pytest.raises(ValueError, match="refused to unpickle") as info:
        run(compose_analyze(tmp_path / "a", f"downstream={run_dir}"), datamodule=TinyData())
    assert str(best) in str(info.value) and not marker.exists()

    marker = crafted_torch_file(upstream, torch.load(upstream, weights_only=True))
    with pytest.raises(ValueError, match="refused to unpickle") as info:
        run(compose_analyze(tmp_path / "b", f"upstream={upstream}"), datamodule=TinyData())
    assert str(upstream) in str(info.value) and not marker.exists()


def test_upstream_with_nonfinite_hidden_states_is_refused(tmp_path: Path, monkeypatch) -> None:
    # weights this large are refused on loading (WEIGHT_LIMIT); lifted here so the states are
    # what gets checked
    monkeypatch.setattr("speechattn.model.upstream.WEIGHT_LIMIT", float("inf"))
    upstream = make_upstream(tmp_path / "upstream.pt")
    state = torch.load(upstream, weights_only=True)
    state["state_dict"]["embedding.proj.weight"] *= 1e30  # finite weights, overflowing states
    torch.save(state, upstream)
    with pytest.raises(ValueError, match="NaN/inf") as info:
        run(compose_analyze(tmp_path / "a", f"upstream={upstream}"), datamodule=TinyData())
    assert str(upstream) in str(info.value)
    assert not (tmp_path / "a" / "heads.json").exists()
