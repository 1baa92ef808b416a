"""`speechattn.tasks.downstream.run` end to end on the tiny built-in corpus (tests/conftest.py).

Each task runs on the mel baseline and on a tiny (untrained) AALBERT upstream saved through the
upstream API; both go through Hydra composition of the real `conf/downstream.yaml`.
"""

import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, open_dict

from speechattn.config import compose
from speechattn.data import DataConfig
from speechattn.tasks.downstream import DownstreamProbe, TaskConfig, check_label_lengths, run
from speechattn.tasks.downstream.features import SplitFeatures, load_split
from speechattn.tasks.records import EXAMPLE_FILE, TASKS, read_result

FAST = [
    "trainer.max_epochs=2",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "early_stopping.patience=1",
    "trainer.log_every_n_steps=1",
    "device=cpu",
]


def data_overrides(config: DataConfig) -> list[str]:
    keep = ("root", "cache_dir", "batch_size", "extract_workers", "shard_size", "progress")
    values = asdict(config)
    return [
        f"data.{k}={str(values[k]).lower() if isinstance(values[k], bool) else values[k]}"
        for k in keep
    ]


def compose_downstream(out: Path, data: DataConfig, *overrides: str) -> DictConfig:
    cfg = compose("downstream", [*data_overrides(data), *FAST, *overrides])
    with open_dict(cfg):
        cfg.output_dir = str(out)
        cfg.cache_dir = str(out.parent / "feature-cache")
    return cfg


@pytest.fixture(scope="module")
def tiny_upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from speechattn.data import Normalizer
    from speechattn.model import aalbert
    from speechattn.model.upstream import save_upstream, upstream_state

    torch.manual_seed(0)
    model = aalbert(feature_dim=80, dim=32, num_layers=2, num_heads=2, ffn_dim=64, attention="full")
    state = upstream_state(
        model, Normalizer(torch.zeros(80), torch.ones(80)), {"n_mels": 80}, {"steps": 3}
    )
    return save_upstream(tmp_path_factory.mktemp("upstream") / "upstream.pt", state)


@pytest.mark.parametrize("task", TASKS)
def test_each_task_on_mel(task: str, tmp_path: Path, tiny_data_config: DataConfig) -> None:
    cfg = compose_downstream(tmp_path / task, tiny_data_config, f"task={task}", "upstream=mel")
    out = run(cfg)
    result = read_result(tmp_path / task / "result.json")
    assert out == result.to_dict()
    assert result.task == task and result.attention == "mel" and result.upstream_sha256 is None
    assert sum(result.split_sizes.values()) == 24  # 4 speakers x 6 utterances
    assert 0.0 <= result.test_accuracy <= 1.0 and result.dev_accuracy > 0.0
    assert result.num_classes == (4 if task.startswith("speaker") else 40)  # eSpeak phone set
    if task == "speaker_utterance":
        assert result.eval_frames["test"] == result.split_sizes["test"]
    else:  # frame tasks score every valid 10 ms frame
        assert result.eval_frames["test"] > 50 * result.split_sizes["test"]
    assert result.code_version and result.created and result.corpus["config"]["root"]
    assert (tmp_path / task / EXAMPLE_FILE).is_file()


@pytest.mark.parametrize(
    "task, extra",
    [
        ("speaker_utterance", ["task.pooling=fused"]),
        ("speaker_frame", ["layer=weighted"]),
        ("phone_1hidden", ["layer=1"]),
        ("phone_2hidden", []),
    ],
)
def test_each_task_on_a_tiny_upstream(
    task: str, extra: list[str], tmp_path: Path, tiny_data_config: DataConfig, tiny_upstream: Path
) -> None:
    cfg = compose_downstream(
        tmp_path / task, tiny_data_config, f"task={task}", f"upstream={tiny_upstream}", *extra
    )
    run(cfg)
    result = read_result(tmp_path / task / "result.json")
    assert result.attention == "full" and len(result.upstream_sha256) == 64
    assert result.model_config["dim"] == 32 and result.pretraining_steps == 3
    assert result.attention_config == {"name": "full", "options": {}}
    assert result.frames_per_utterance > 0
    if "layer=weighted" in extra:
        assert result.probe["layers"] == [0, 1, 2] and len(result.probe["layer_weights"]) == 3
    if "layer=1" in extra:
        assert result.probe["layers"] == [1]
    if task == "speaker_utterance":
        assert result.pooling == "fused"


def test_features_are_extracted_once(
    tmp_path: Path, tiny_data_config: DataConfig, tiny_upstream: Path
) -> None:
    first = compose_downstream(
        tmp_path / "a", tiny_data_config, "task=speaker_frame", f"upstream={tiny_upstream}"
    )
    run(first)
    cache = sorted((tmp_path / "feature-cache").rglob("*.pt"))
    assert [p.name for p in cache] == ["dev.pt", "test.pt", "train.pt"]
    stamps = [p.stat().st_mtime_ns for p in cache]
    second = compose_downstream(
        tmp_path / "b", tiny_data_config, "task=phone_1hidden", f"upstream={tiny_upstream}"
    )
    run(second)  # same upstream, layer and data: the cache is reused
    assert [
        p.stat().st_mtime_ns for p in sorted((tmp_path / "feature-cache").rglob("*.pt"))
    ] == stamps
    third = compose_downstream(
        tmp_path / "c",
        tiny_data_config,
        "task=phone_1hidden",
        f"upstream={tiny_upstream}",
        "layer=0",
    )
    run(third)  # another layer: another cache entry
    assert len(list((tmp_path / "feature-cache").rglob("train.pt"))) == 2


def test_a_damaged_cached_split_is_extracted_again(
    tmp_path: Path, tiny_data_config: DataConfig, tiny_upstream: Path, caplog
) -> None:
    cfg = compose_downstream(
        tmp_path / "a", tiny_data_config, "task=speaker_frame", f"upstream={tiny_upstream}"
    )
    run(cfg)
    (train,) = (tmp_path / "feature-cache").rglob("train.pt")
    before = load_split(train)
    good = train.read_bytes()
    train.write_bytes(good[:-100] + bytes(100))  # the tail overwritten, size unchanged
    again = compose_downstream(
        tmp_path / "b", tiny_data_config, "task=speaker_frame", f"upstream={tiny_upstream}"
    )
    with caplog.at_level(logging.WARNING):
        run(again)
    assert "the file does not match its sha256 record; extracting it again" in caplog.text
    after = load_split(train)  # matches its new record
    assert after.utt_ids == before.utt_ids and torch.equal(after.features, before.features)


def test_phone_task_without_alignments_names_the_file(
    tmp_path: Path, tiny_data_config: DataConfig
) -> None:
    cfg = compose_downstream(
        tmp_path / "p", tiny_data_config, "task=phone_1hidden", "data.alignments=missing_phones.txt"
    )
    with pytest.raises(FileNotFoundError, match="missing_phones.txt") as info:
        run(cfg)
    assert "converted_aligned_phones.txt" in str(info.value)
    # Speaker tasks do not need phone labels: the same corpus still works for them.
    cfg = compose_downstream(
        tmp_path / "s",
        tiny_data_config,
        "task=speaker_utterance",
        "data.alignments=missing_phones.txt",
    )
    assert run(cfg)["task"] == "speaker_utterance"


def test_label_length_mismatch_names_the_utterance() -> None:
    split = SplitFeatures(
        utt_ids=["good", "bad"],
        features=torch.zeros(20, 1, 4, dtype=torch.float16),
        lengths=torch.tensor([10, 10]),  # 10 model frames x 3 = 30 label frames
        input_lengths=torch.tensor([30, 30]),
        speakers=torch.tensor([0, 1]),
        phones=torch.zeros(30 + 40, dtype=torch.long),
        phone_lengths=torch.tensor([30, 40]),
    )
    with pytest.raises(ValueError, match="utterance bad"):
        check_label_lengths(split, downsample=3, tolerance=2)
    split.phone_lengths = torch.tensor([30, 31])
    check_label_lengths(split, downsample=3, tolerance=2)  # within tolerance: fine


def test_frame_logits_are_repeated_and_trimmed_to_the_labels() -> None:
    task = TaskConfig(name="phone_1hidden", target="phones", level="frame", hidden_layers=0)
    probe = DownstreamProbe(
        task, input_dim=1, num_layers=1, num_classes=2, downsample=3, tolerance=2
    )
    with torch.no_grad():
        probe.head.net[0].weight.fill_(1.0)
        probe.head.net[0].bias.zero_()
    hidden = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).reshape(1, 1, 4, 1)  # (B, N, T', D)
    batch = {
        "hidden": hidden,
        "lengths": torch.tensor([4]),
        "padding_mask": torch.zeros(1, 4, dtype=torch.bool),
        "label_lengths": torch.tensor([11]),  # 4 x 3 = 12 frames, trimmed to 11
        "utt_ids": ["u"],
    }
    logits = probe(batch)  # (B, T, C)
    assert logits.shape == (1, 11, 2)
    assert logits[0, :, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]


def test_result_json_has_the_promised_fields(tmp_path: Path, tiny_data_config: DataConfig) -> None:
    cfg = compose_downstream(
        tmp_path / "r", tiny_data_config, "task=speaker_utterance", "upstream=mel"
    )
    run(cfg)
    data = json.loads((tmp_path / "r" / "result.json").read_text())
    for key in (
        "task",
        "upstream",
        "upstream_sha256",
        "attention",
        "model_config",
        "pretraining_steps",
        "corpus",
        "split_sizes",
        "dev_accuracy",
        "test_accuracy",
        "seed",
        "code_version",
        "layer",
    ):
        assert key in data, key
    assert set(data["split_sizes"]) == {"train", "dev", "test"}
