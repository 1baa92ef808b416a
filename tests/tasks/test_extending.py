"""docs/extending.md's worked example, kept honest: the "add a downstream task" section shows
`speechattn/tasks/downstream/labels/pitch.py` and `conf/task/pitch_utterance.yaml` verbatim
(checked here), and the task they add trains through the unchanged downstream job and learns.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_downstream_run import compose_downstream, tiny_upstream  # noqa: F401  (fixture)

from speechattn import CONFIG_DIR
from speechattn.config import compose
from speechattn.data import DataConfig
from speechattn.data.librispeech import speaker_of
from speechattn.tasks.downstream import TaskConfig, run
from speechattn.tasks.downstream.labels import label_source
from speechattn.tasks.records import read_result

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "extending.md"
EXAMPLE_FILES = {
    "speechattn/tasks/downstream/labels/pitch.py": REPO
    / "speechattn/tasks/downstream/labels/pitch.py",
    "conf/task/pitch_utterance.yaml": CONFIG_DIR / "task" / "pitch_utterance.yaml",
}


def shown_files(doc: str) -> dict[str, str]:
    """The files docs/extending.md shows in full: a fenced block right after a line naming the
    file as `path` followed by a colon."""
    blocks = re.finditer(r"`([\w/.]+)`:\n\n```\w*\n(.*?)```", doc, re.S)
    return {m.group(1): m.group(2) for m in blocks}


def test_the_guide_shows_the_example_files_as_they_are() -> None:
    shown = shown_files(DOC.read_text())
    for name, path in EXAMPLE_FILES.items():
        assert name in shown, f"docs/extending.md does not show {name}"
        assert shown[name] == path.read_text(), f"docs/extending.md shows an old {name}"


def test_the_example_task_composes_as_a_group_option() -> None:
    task = TaskConfig(**compose("downstream", ["task=pitch_utterance"]).task)
    assert (task.name, task.target, task.level) == ("pitch_utterance", "pitch", "utterance")
    assert label_source("pitch").per_frame is False


def test_pitch_labels_are_the_halves_of_the_speakers_pitches(tiny_data_config: DataConfig):
    from speechattn.data import LabelledDataModule

    datamodule = LabelledDataModule(tiny_data_config)
    labels = TaskConfig(name="pitch_utterance", target="pitch").labels(datamodule)
    speakers = json.loads((Path(tiny_data_config.root) / "speakers.json").read_text())
    pitch = {s: v["pitch"] for s, v in speakers.items()}
    low = sorted(pitch, key=lambda s: (pitch[s], s))[: len(pitch) // 2]
    for speaker in pitch:
        utt = f"{speaker}-1-0000"
        assert speaker_of(utt) == speaker
        assert labels.utterance_label(utt) == int(speaker not in low)
    assert labels.num_classes() == 2


def test_the_example_task_trains_and_learns(tmp_path: Path, tiny_data_config: DataConfig) -> None:
    out = tmp_path / "pitch"
    cfg = compose_downstream(
        out, tiny_data_config, "task=pitch_utterance", "upstream=mel", "trainer.max_epochs=30",
        "early_stopping.patience=30", "logger=none",
    )  # fmt: skip
    run(cfg)
    result = read_result(out / "result.json")
    assert result.task == "pitch_utterance" and result.num_classes == 2
    assert result.eval_frames["test"] == result.split_sizes["test"]  # one label per utterance
    rows = [line.split(",") for line in (out / "logs" / "metrics.csv").read_text().splitlines()]
    column = rows[0].index("train_acc")
    train_acc = [float(r[column]) for r in rows[1:] if r[column]]
    assert train_acc[-1] >= 0.9 > train_acc[0], train_acc  # it learns the labels of train
    assert result.dev_accuracy > 0.5  # and they generalise beyond chance (two balanced classes)


def test_an_unknown_target_names_the_folder_to_add_it_to() -> None:
    with pytest.raises(ValueError, match="labels/loudness.py"):
        TaskConfig(name="loudness_utterance", target="loudness")


def test_the_head_analysis_reads_the_example_task(
    tmp_path: Path,
    tiny_data_config: DataConfig,
    tiny_upstream: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    """The analysis job needs no change either: it asks the task's label source for labels."""
    from speechattn.analyze import compose_config
    from speechattn.analyze import run as analyze

    probe_run = tmp_path / "pitch"
    cfg = compose_downstream(
        probe_run, tiny_data_config, "task=pitch_utterance", f"upstream={tiny_upstream}",
        "logger=none",
    )  # fmt: skip
    run(cfg)
    overrides = [f"output_dir={tmp_path / 'heads'}", "progress=false", "figures=false"]
    heads = analyze(compose_config([*overrides, f"downstream={probe_run}", "num_batches=2"]))
    assert heads["task"] == "pitch_utterance" and heads["metric"] == "accuracy"
    assert heads["split"] == "dev" and heads["downstream"]["dir"] == str(probe_run)
    assert heads["subset"]["scored"] == heads["subset"]["utterances"] > 0  # one label each
    assert 0.0 <= heads["base_metric"] <= 1.0
