"""Downstream building blocks on synthetic tensors: layers, mel upstream, cache, probe training."""

from pathlib import Path

import pytest
import torch

from speechattn.tasks.downstream import ProbeDataset, TaskConfig, collate, fit_probe
from speechattn.tasks.downstream.features import (
    DamagedSplit,
    MelUpstream,
    SplitFeatures,
    extract_split,
    load_split,
    resolve_layers,
    save_split,
)

TRAINER = dict(
    max_epochs=15,
    accelerator="cpu",
    devices=1,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    log_every_n_steps=1,
)


def synthetic_split(
    num_utts: int, num_speakers: int, layers: int = 1, dim: int = 6, seed: int = 0
) -> SplitFeatures:
    """Utterances whose frames scatter around a per-speaker centre (only in the last layer)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_speakers, dim, generator=torch.Generator().manual_seed(123)) * 2
    speakers = torch.arange(num_utts) % num_speakers
    lengths = torch.randint(4, 15, (num_utts,), generator=g)
    feats = []
    for s, n in zip(speakers.tolist(), lengths.tolist()):
        x = torch.randn(n, layers, dim, generator=g)
        x[:, -1] += centres[s]
        feats.append(x)
    return SplitFeatures(
        utt_ids=[f"utt{seed}-{i}" for i in range(num_utts)],
        features=torch.cat(feats).half(),
        lengths=lengths,
        input_lengths=lengths * 3,
        speakers=speakers,
    )


@pytest.mark.parametrize(
    "layer, expected",
    [("last", [4]), (0, [0]), (-1, [4]), ("2", [2]), ("weighted", [0, 1, 2, 3, 4])],
)
def test_resolve_layers(layer, expected) -> None:
    assert resolve_layers(layer, num_layers=4) == expected


@pytest.mark.parametrize("layer, message", [(5, "out of range"), ("first", "unknown layer choice")])
def test_resolve_layers_rejects(layer, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_layers(layer, num_layers=4)


def test_mel_upstream_is_the_input_with_padding_zeroed() -> None:
    up = MelUpstream(3)
    x = torch.ones(2, 4, 3)
    lengths = torch.tensor([4, 2])
    out = up(x, lengths)
    (h,) = out.hidden_states
    assert h.shape == (2, 4, 3) and h[1, 2:].abs().sum() == 0 and h[0].sum() == 12
    assert out.last_hidden_state is h and out.attentions is None
    assert torch.equal(out.output_lengths, lengths)
    assert up(x, lengths, output_attentions=True).attentions == ()  # no layers, no weights
    assert torch.equal(up.output_lengths(lengths), lengths)
    assert up.downsample == 1 and up.num_layers == 0 and up.attention_name == "mel"


def test_extract_split_keeps_each_utterance_and_its_labels() -> None:
    x = torch.randn(3, 5, 2)
    lengths = torch.tensor([5, 3, 1])
    phones = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, -100, -100], [9, -100, -100, -100, -100]])
    batch = {
        "features": x,
        "lengths": lengths,
        "padding_mask": torch.arange(5)[None] >= lengths[:, None],
        "utt_ids": ["a", "b", "c"],
        "speaker": torch.tensor([0, 1, 0]),
        "phones": phones,
        "phone_lengths": lengths,
    }
    split = extract_split(MelUpstream(2), [batch], layers=[0], total=1)
    assert split.utt_ids == ["a", "b", "c"] and split.lengths.tolist() == [5, 3, 1]
    assert torch.allclose(split.hidden(1), x[1, :3][None], atol=1e-3)  # (N=1, T', D)
    assert split.phones_of(1).tolist() == [6, 7, 8]
    assert split.speakers.tolist() == [0, 1, 0]


def test_cache_round_trip_is_atomic(tmp_path: Path) -> None:
    split = synthetic_split(5, 2, layers=2)
    path = tmp_path / "k" / "train.pt"
    save_split(split, path)
    # no temp file left behind; the checksum record commits the split
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.pt", "train.pt.sha256"]
    back = load_split(path)
    assert back.utt_ids == split.utt_ids and torch.equal(back.features, split.features)
    assert torch.equal(back.hidden(3), split.hidden(3))


def test_cached_split_is_read_only_when_it_matches_its_record(tmp_path: Path) -> None:
    path = tmp_path / "k" / "train.pt"
    save_split(synthetic_split(5, 2, layers=2), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedSplit, match=r"train\.pt: the file does not match its sha256"):
        load_split(path)
    save_split(synthetic_split(5, 2, layers=2), path)
    (tmp_path / "k" / "train.pt.sha256").unlink()  # e.g. killed between the two writes
    with pytest.raises(DamagedSplit, match=r"train\.pt: no checksum record train\.pt\.sha256"):
        load_split(path)


def test_split_fields_must_agree() -> None:
    split = synthetic_split(5, 2, layers=2)
    state = split.state()
    with pytest.raises(ValueError, match="lengths sum to"):
        SplitFeatures(**{**state, "lengths": state["lengths"] + 1})
    with pytest.raises(ValueError, match="5 utterance ids but per-utterance fields"):
        SplitFeatures(**{**state, "input_lengths": state["input_lengths"][:4]})


def test_collate_pads_features_and_frame_labels() -> None:
    split = synthetic_split(4, 2, layers=2)
    task = TaskConfig(name="speaker_frame", target="speaker", level="frame")
    batch = collate([ProbeDataset(split, task)[i] for i in range(4)])
    T = int(split.lengths.max())
    assert batch["hidden"].shape == (4, 2, T, 6)
    assert batch["padding_mask"].sum(1).tolist() == (T - split.lengths).tolist()
    assert batch["labels"].shape == (4, int(split.input_lengths.max()))
    assert batch["label_lengths"].tolist() == split.input_lengths.tolist()
    assert (batch["labels"] == -100).sum(1).tolist() == (
        batch["labels"].size(1) - split.input_lengths
    ).tolist()


def test_missing_labels_are_named() -> None:
    split = synthetic_split(3, 2)
    with pytest.raises(ValueError, match="no phone labels"):
        ProbeDataset(split, TaskConfig(name="phone_1hidden", target="phones", level="frame"))


def test_utterance_probe_training_selects_on_dev(tmp_path: Path) -> None:
    splits = {
        name: synthetic_split(n, 4, layers=3, seed=i)
        for i, (name, n) in enumerate([("train", 96), ("dev", 24), ("test", 24)])
    }
    task = TaskConfig(
        name="speaker_utterance", target="speaker", level="utterance", batch_size=16, lr=1e-2
    )
    fit = fit_probe(
        task,
        splits,
        num_classes=4,
        downsample=3,
        tolerance=3,
        trainer_kwargs=TRAINER,
        patience=5,
        out=tmp_path,
    )
    assert fit.dev_accuracy > 0.9 and fit.test_accuracy > 0.9
    assert 0 <= fit.best_epoch <= fit.epochs_trained
    # Only the last cached layer carries the speaker: the learned mix should favour it.
    assert fit.layer_weights is not None and max(fit.layer_weights) == fit.layer_weights[-1]
    assert len(list((tmp_path / "checkpoints").glob("*.ckpt"))) == 1
