"""Corpus readers beside LibriSpeech: any folder of audio, lhotse manifests (prepared by lhotse's
own LibriSpeech recipe from a copy of the built-in corpus). Each must give the same features and
labels as the native reader for the same audio, and refuse bad input naming the file."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speechattn.data import DataConfig, LabelledDataModule, PretrainDataModule
from speechattn.data.cache import FeatureStore, open_source
from speechattn.data.corpora import FolderSource, folder_speaker
from speechattn.data.datamodules import extraction_settings
from speechattn.data.errors import DataError, Issues
from speechattn.data.features import LogMel
from speechattn.data.librispeech import read_alignments, read_phone_set, scan_split
from speechattn.errors import ConfigError

SPLIT = "synth-clean"


def _config(tiny_data_config: DataConfig, **changes) -> DataConfig:
    fields = {**dataclasses.asdict(tiny_data_config), **changes}
    return DataConfig(**fields)


def _setup(module):
    module.prepare_data()
    module.setup("fit")
    return module


def _items(module, role: str) -> dict[str, dict]:
    """utt_id -> item (features, speaker, phones) of one role, in a deterministic read."""
    dataset = (
        module.extraction_dataloader(role).dataset if role != "val" else module.datasets["val"]
    )
    return {item["utt_id"]: item for item in (dataset[i] for i in range(len(dataset)))}


# ----------------------------------------------------------------------------- folder


@pytest.fixture
def audio_folder(tiny_corpus: Path, tmp_path: Path) -> Path:
    """The tiny corpus's audio as a researcher's folder: <speaker>/<session>/<name>.<ext>, with
    WAV, FLAC, OGG and MP3 files, one at 8 kHz."""
    root = tmp_path / "my_audio"
    for k, utt in enumerate(scan_split(tiny_corpus, SPLIT)):
        speaker, chapter, number = utt.utt_id.split("-")
        target = root / f"spk{speaker}" / f"session{chapter}"
        target.mkdir(parents=True, exist_ok=True)
        audio, rate = sf.read(utt.path, dtype="float32")
        if k % 3 == 0:
            sf.write(target / f"take{number}.wav", audio, rate, subtype="PCM_16")
        elif k == 1:
            sf.write(target / f"take{number}.ogg", audio, rate)
        elif k == 2:
            sf.write(target / f"take{number}.mp3", audio, rate)
        elif k == 4:  # 8 kHz: resampled, with a note
            sf.write(target / f"take{number}.flac", audio[::2], rate // 2)
        else:
            shutil.copy2(utt.path, target / f"take{number}.flac")
    (root / "notes.txt").write_text("not audio")
    return root


def test_a_folder_of_audio_is_a_corpus(
    audio_folder: Path, tiny_data_config: DataConfig, monkeypatch
):
    cfg = _config(tiny_data_config, corpus="folder", root=str(audio_folder),
                  pretrain_splits=["."], speaker_level=0, pretrain_exclude_test=False)  # fmt: skip
    dm = _setup(PretrainDataModule(cfg))
    ids = sorted(dm.datasets["train"].utt_ids + dm.datasets["val"].utt_ids)
    assert len(ids) == 24 and ids[0].startswith("spk") and ids[0].count("/") == 2
    assert len({dm.corpus.speaker_of(u) for u in ids}) == 4
    store = next(iter(dm._splits.values()))
    # same samples, same features: WAV (16-bit) and FLAC hold the same integers
    native = FeatureStore(next(iter(_native_stores(tiny_data_config).values())).manifest)
    wav = next(u for u in store.utt_ids if (audio_folder / f"{u}.wav").exists())
    speaker, chapter, number = (
        wav.replace("spk", "").replace("session", "").replace("take", "").split("/")
    )
    np.testing.assert_array_equal(store.raw(wav), native.raw(f"{speaker}-{chapter}-{number}"))
    assert [n for _, n in store.notes if "resampled from 8000 Hz" in n]
    assert {Path(u).suffix for u in store.utt_ids} == {""}  # ids carry no suffix
    assert sum(1 for p in audio_folder.rglob("*.mp3")) == 1 and len(store.utt_ids) == 24
    # a second start reads nothing but the listing: the same manifest, no scan
    monkeypatch.setattr(FolderSource, "scan", lambda *a: pytest.fail("scanned a warm folder"))
    again = open_source(FolderSource(audio_folder.resolve(), ".", 0), extraction_settings(cfg),
                        cfg.cache_root(), workers=1, progress=False)  # fmt: skip
    assert again.manifest == store.manifest


def _native_stores(cfg: DataConfig) -> dict[str, FeatureStore]:
    dm = _setup(PretrainDataModule(cfg))
    return dm._splits


def test_folder_speaker_levels():
    assert folder_speaker("a/b/c/file", 0) == "a" and folder_speaker("a/b/c/file", -1) == "c"
    with pytest.raises(ValueError, match="speaker_level=2.*1 folder"):
        folder_speaker("a/file", 2)


def test_a_folder_without_audio_is_refused_naming_it(tmp_path: Path, tiny_data_config):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "readme.txt").write_text("no audio here")
    cfg = _config(
        tiny_data_config, corpus="folder", root=str(tmp_path / "empty"), pretrain_splits=["."]
    )
    with pytest.raises(DataError, match=r"empty.*no usable utterances.*no audio files"):
        _setup(PretrainDataModule(cfg))


@pytest.mark.parametrize("on_error", ["error", "skip"])
def test_unreadable_files_in_a_folder_follow_on_error(
    audio_folder: Path, tiny_data_config, on_error
):
    bad = audio_folder / "spk9" / "broken.wav"
    bad.parent.mkdir()
    bad.write_bytes(b"RIFF....WAVEfmt garbage")
    twin = sorted(audio_folder.rglob("*.flac"))[0]
    shutil.copy2(twin, twin.with_suffix(".wav"))  # two files, one utterance id
    (audio_folder / "spk9" / "gone.flac").symlink_to(audio_folder / "nowhere.flac")
    cfg = _config(tiny_data_config, corpus="folder", root=str(audio_folder), pretrain_splits=["."],
                  on_error=on_error, pretrain_exclude_test=False)  # fmt: skip
    if on_error == "error":
        with pytest.raises(DataError, match=r"\.wav \[spk.*\]: duplicate utterance \(take"):
            _setup(PretrainDataModule(cfg))
        return
    dm = _setup(PretrainDataModule(cfg))
    problems = {(Path(s.path).name, s.problem) for s in dm.skipped}
    assert ("gone.flac", "broken symlink") in problems
    assert ("broken.wav", "unreadable audio") in problems
    assert (twin.with_suffix(".wav").name, "duplicate utterance") in problems
    assert len(dm.datasets["train"]) + len(dm.datasets["val"]) == 24


def test_the_folder_corpus_needs_a_root_and_a_speaker_level_for_speakers(
    tiny_data_config, audio_folder
):
    with pytest.raises(ConfigError, match="data.root is required for corpus=folder"):
        DataConfig(corpus="folder")
    cfg = _config(tiny_data_config, corpus="folder", root=str(audio_folder), pretrain_splits=["."])
    dm = PretrainDataModule(cfg)
    with pytest.raises(ConfigError, match="speaker_level is null"):
        dm.corpus.speaker_of("spk1/session1/take0001")


# ----------------------------------------------------------------------------- lhotse


@pytest.fixture(scope="module")
def lhotse_copy(tiny_corpus: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(LibriSpeech-layout copy of the built-in corpus, lhotse manifests prepared from it by
    lhotse's own recipe, with the corpus's 10 ms phone labels as alignment["phone"] items)."""
    lhotse = pytest.importorskip("lhotse")
    from lhotse.recipes import prepare_librispeech
    from lhotse.supervision import AlignmentItem

    base = tmp_path_factory.mktemp("lhotse")
    copy, manifests = base / "LibriSpeech", base / "manifests"
    copy.mkdir()
    (copy / "dev-clean").symlink_to(tiny_corpus / SPLIT)  # a split name the recipe knows
    for name in (
        "converted_aligned_phones.txt",
        "train_split.txt",
        "test_split.txt",
        "phone_set.txt",
    ):
        shutil.copy2(tiny_corpus / name, copy / name)
    prepare_librispeech(copy, dataset_parts=["dev-clean"], output_dir=manifests)
    for name in ("train_split.txt", "test_split.txt", "phone_set.txt"):
        shutil.copy2(tiny_corpus / name, manifests / name)
    phone_set = read_phone_set(tiny_corpus / "phone_set.txt")
    labels = read_alignments(tiny_corpus / "converted_aligned_phones.txt", phone_set)
    path = next(manifests.glob("*_supervisions_dev-clean.jsonl.gz"))
    supervisions = lhotse.load_manifest(path)
    aligned = [
        s.with_alignment("phone", _items_of(labels[s.id], phone_set, AlignmentItem))
        for s in supervisions
    ]
    lhotse.SupervisionSet.from_segments(aligned).to_file(path)
    return copy, manifests


def _items_of(frames: np.ndarray, phone_set: list[str], item) -> list:
    """10 ms frame labels -> one alignment item per run (times in seconds)."""
    cut = np.flatnonzero(np.diff(frames)) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, len(frames)]
    return [
        item(phone_set[frames[a]], round(a * 0.01, 4), round((b - a) * 0.01, 4))
        for a, b in zip(starts, ends)
    ]


def test_lhotse_manifests_give_the_native_readers_features_and_labels(
    lhotse_copy, tiny_data_config
):
    copy, manifests = lhotse_copy
    native_cfg = _config(tiny_data_config, corpus="librispeech", root=str(copy),
                         pretrain_splits=["dev-clean"], labelled_splits=["dev-clean"])  # fmt: skip
    lhotse_cfg = _config(tiny_data_config, corpus="lhotse", root=str(manifests), alignments="phone",
                         pretrain_splits=["dev-clean"], labelled_splits=["dev-clean"])  # fmt: skip
    native, ours = _setup(LabelledDataModule(native_cfg)), _setup(LabelledDataModule(lhotse_cfg))
    assert ours.speakers == native.speakers and ours.phone_set == native.phone_set
    for role in ("train", "dev", "test"):
        a, b = _items(native, role), _items(ours, role)
        assert sorted(a) == sorted(b) and a
        for u in a:
            np.testing.assert_array_equal(a[u]["features"], b[u]["features"])
            np.testing.assert_array_equal(a[u]["phones"], b[u]["phones"])
            assert a[u]["speaker"] == b[u]["speaker"]
    native, ours = _setup(PretrainDataModule(native_cfg)), _setup(PretrainDataModule(lhotse_cfg))
    for role in ("train", "val"):
        assert sorted(native.datasets[role].utt_ids) == sorted(ours.datasets[role].utt_ids)
    a, b = native._splits["dev-clean"], ours._splits["dev-clean"]
    assert a.shard_keys == b.shard_keys and len(
        a.shard_keys
    )  # whole files: the very shards the native reader made


def test_a_cutset_of_segments_reads_each_segment_and_its_labels(
    lhotse_copy, tiny_data_config, tmp_path
):
    lhotse = pytest.importorskip("lhotse")
    _, manifests = lhotse_copy
    recordings = lhotse.load_manifest(next(manifests.glob("*_recordings_dev-clean.jsonl.gz")))
    supervisions = lhotse.load_manifest(next(manifests.glob("*_supervisions_dev-clean.jsonl.gz")))
    cuts = lhotse.CutSet.from_manifests(recordings, supervisions)
    segments = lhotse.CutSet.from_cuts(
        c.truncate(offset=0.5, duration=1.2, keep_excessive_supervisions=True).with_id(
            c.supervisions[0].id
        )
        for c in cuts
    )
    path = tmp_path / "segments.jsonl.gz"
    segments.to_file(path)
    for name in ("train_split.txt", "test_split.txt", "phone_set.txt"):
        shutil.copy2(manifests / name, tmp_path / name)
    cfg = _config(tiny_data_config, corpus="lhotse", root=None, cuts=str(path), alignments="phone",
                  pretrain_splits=[], labelled_splits=[], label_tolerance=2)  # fmt: skip
    assert cfg.root == str(tmp_path) and cfg.pretrain_splits == ["segments.jsonl.gz"]
    dm = _setup(LabelledDataModule(cfg))
    store = dm._splits["segments.jsonl.gz"]
    utt = sorted(store.utt_ids)[0]
    rec = recordings[utt]
    audio, rate = sf.read(rec.sources[0].source, dtype="float32")
    expected = LogMel(dm.feature_config)(audio[8000 : 8000 + 19200]).numpy()
    np.testing.assert_allclose(store.raw(utt).astype(np.float32), expected, atol=2e-3, rtol=1e-3)
    native = read_alignments(manifests / "../LibriSpeech/converted_aligned_phones.txt",
                             read_phone_set(manifests / "phone_set.txt"))  # fmt: skip
    labels, _, _ = dm.corpus.phone_labels([utt], Issues())
    np.testing.assert_array_equal(labels[utt], native[utt][50 : 50 + len(labels[utt])])
    assert len(labels[utt]) == 120


def _rewrite(path: Path, edit) -> None:
    """Apply `edit(dict) -> dict | None` (None drops the line) to each line of a jsonl.gz."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in (edit(r) for r in rows) if r is not None]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def lhotse_bad(lhotse_copy, tmp_path) -> Path:
    """A private copy of the manifests, free to damage."""
    return Path(shutil.copytree(lhotse_copy[1], tmp_path / "manifests"))


@pytest.mark.parametrize("on_error", ["error", "skip"])
def test_bad_lhotse_manifests_are_named(lhotse_bad, tiny_data_config, on_error):
    recordings = next(lhotse_bad.glob("*_recordings_dev-clean.jsonl.gz"))
    supervisions = next(lhotse_bad.glob("*_supervisions_dev-clean.jsonl.gz"))
    victims: list[str] = []

    def drop_first(row):
        if not victims:
            victims.append(row["id"])
            return None
        return row

    _rewrite(recordings, drop_first)  # a supervision whose recording is missing

    def move_audio(row):
        if len(victims) == 1:
            victims.append(row["id"])
            row["sources"][0]["source"] += ".moved"
        return row

    _rewrite(recordings, move_audio)  # a recording whose file is missing

    def late_alignment(row):
        if row["id"] not in victims and len(victims) == 2:
            victims.append(row["id"])
            row["alignment"]["phone"] = [a for a in row["alignment"]["phone"] if a[1] > 0.5]
        return row

    _rewrite(supervisions, late_alignment)  # an alignment that does not cover the audio
    twice: list[dict] = []

    def repeat_last(row):
        twice[:] = [row]
        return row

    _rewrite(supervisions, repeat_last)
    with gzip.open(supervisions, "at") as f:  # the last supervision's id once more
        f.write(json.dumps(twice[0]) + "\n")
    cfg = _config(tiny_data_config, corpus="lhotse", root=str(lhotse_bad), alignments="phone",
                  pretrain_splits=["dev-clean"], labelled_splits=["dev-clean"], on_error=on_error)  # fmt: skip
    if on_error == "error":
        with pytest.raises(DataError, match=rf"supervisions.*\[{victims[0]}\]: missing recording"):
            _setup(LabelledDataModule(cfg))
        return
    dm = _setup(LabelledDataModule(cfg))
    problems = {s.utt_id: s.problem for s in dm.skipped}
    assert problems[victims[0]] == "missing recording"
    assert problems[victims[1]] == "missing audio file"
    assert problems[victims[2]] == "alignment does not cover the audio"
    assert problems[twice[0]["id"]] == "duplicate utterance"
    kept = {u for role in ("train", "dev", "test") for u in dm.datasets[role].utt_ids}
    assert not kept & set(victims)


def test_lhotse_config_needs_cuts_or_root_and_splits():
    with pytest.raises(ConfigError, match="corpus=lhotse needs data.cuts"):
        DataConfig(corpus="lhotse", pretrain_splits=[], labelled_splits=[])
    with pytest.raises(DataError, match="lhotse manifests not found.*dev-other"):
        from speechattn.data.corpora import manifests_of

        manifests_of(Path("."), "dev-other")


@pytest.mark.slow
def test_the_command_line_pretrains_on_a_folder_and_probes_from_lhotse(
    audio_folder, lhotse_copy, tmp_path
):
    """As a user runs it: pretraining on an audio folder, then a phone probe of that upstream
    on the lhotse manifests."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                              env=env, timeout=600, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    run("speechattn.pretrain", "data=folder", f"data.root={audio_folder}", "data.speaker_level=0",
        "trainer.max_steps=2", "trainer.val_check_interval=2", f"hydra.run.dir={tmp_path / 'up'}")  # fmt: skip
    splits = ["data.pretrain_splits=[dev-clean]", "data.labelled_splits=[dev-clean]"]
    run("speechattn.downstream", "task=phone_1hidden", "data=lhotse", f"data.root={lhotse_copy[1]}",
        *splits, f"upstream={tmp_path / 'up' / 'upstream.pt'}", "trainer.max_epochs=1",
        f"hydra.run.dir={tmp_path / 'down'}")  # fmt: skip
    result = json.loads((tmp_path / "down" / "result.json").read_text())
    assert 0 < result["test_accuracy"] <= 1 and result["corpus"]["corpus"] == "lhotse"
