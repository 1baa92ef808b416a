"""Bad input (docs/data.md): each defect raises a DataError naming file and problem, or under
`on_error=skip` is skipped, counted, logged and listed in `datamodule.skipped`."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

from speechattn.data import DataError, LabelledDataModule, PretrainDataModule
from speechattn.data.audio import flac_audio_bytes
from speechattn.data.cache import open_split
from speechattn.data.datamodules import extraction_settings
from speechattn.data.errors import Issues
from speechattn.data.librispeech import find_splits, read_alignments, scan_split


@pytest.fixture
def corpus(tiny_corpus, tmp_path) -> Path:
    root = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, root)
    return root


def _victim(root: Path) -> tuple[str, Path]:
    """A training utterance to damage, and its audio path."""
    utt = (root / "train_split.txt").read_text().split()[0]
    spk, chapter, _ = utt.split("-")
    return utt, root / "synth-clean" / spk / chapter / f"{utt}.flac"


def _edit_alignment(root: Path, utt: str, edit) -> None:
    path = root / "converted_aligned_phones.txt"
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith(utt + " "):
            tokens = line.split()[1:]
            line = " ".join([utt, *edit(tokens)])
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def _drop_transcript(root: Path, utt: str) -> None:
    spk, chapter, _ = utt.split("-")
    trans = root / "synth-clean" / spk / chapter / f"{spk}-{chapter}.trans.txt"
    trans.write_text(
        "".join(ln + "\n" for ln in trans.read_text().splitlines() if not ln.startswith(utt))
    )


_BAD_VALUES = {"nan_samples": np.nan, "inf_samples": -np.inf, "huge_samples": 1e25}


def _damage(case: str, root: Path) -> tuple[str, str, str]:
    """Apply one defect; returns (utterance, file name expected in the message, problem)."""
    utt, flac = _victim(root)
    align = "converted_aligned_phones.txt"
    if case == "unreadable":
        flac.write_bytes(b"this is not a flac file" * 50)
        return utt, flac.name, "unreadable audio"
    if case == "truncated":
        data = flac.read_bytes()
        flac.write_bytes(data[: len(data) // 2])
        return utt, flac.name, "truncated or corrupt audio"
    if case == "empty":
        flac.write_bytes(b"")
        return utt, flac.name, "empty audio"
    if case == "too_short":
        sf.write(flac, np.zeros(1000, np.float32), 16000, format="FLAC")  # < 10 frames
        return utt, flac.name, "too short"
    if case == "wrong_rate":
        audio, _ = sf.read(str(flac), dtype="float32")
        sf.write(
            flac, AF.resample(torch.from_numpy(audio), 16000, 8000).numpy(), 8000, format="FLAC"
        )
        return utt, flac.name, "wrong sample rate"
    if case == "missing_transcript":
        _drop_transcript(root, utt)
        return utt, flac.name, "missing transcript"
    if case == "alignment_length":
        _edit_alignment(root, utt, lambda t: t[:-10])
        return utt, align, "alignment length mismatch"
    if case == "unknown_symbol":
        _edit_alignment(root, utt, lambda t: [*t[:5], "XX", *t[6:]])
        return utt, align, "unknown phone symbol"
    if case == "class_out_of_range":
        _edit_alignment(root, utt, lambda t: [*t[:5], "99", *t[6:]])
        return utt, align, "unknown phone symbol"
    if case == "missing_alignment":
        _edit_alignment(root, utt, lambda t: t)
        path = root / align
        path.write_text(
            "".join(ln + "\n" for ln in path.read_text().splitlines() if not ln.startswith(utt))
        )
        return utt, align, "missing alignment"
    if case == "header_only":  # a FLAC cut after its metadata, length field "unknown"
        data = bytearray(flac.read_bytes())
        data[8 + 13] &= 0xF0  # STREAMINFO total samples (36 bits) = 0: libsndfile says 2**63-1
        data[8 + 14 : 8 + 18] = bytes(4)
        flac.write_bytes(bytes(data[: len(data) - flac_audio_bytes(flac)]))
        return utt, flac.name, "empty audio"
    if case == "duplicate_alignment":  # a second line for the same utterance
        path = root / align
        line = next(ln for ln in path.read_text().splitlines() if ln.startswith(utt + " "))
        path.write_text(path.read_text() + line.replace(" 1", " 2") + "\n")
        return utt, align, "duplicate alignment"
    if case == "duplicate_transcript":
        spk, chapter, _ = utt.split("-")
        trans = root / "synth-clean" / spk / chapter / f"{spk}-{chapter}.trans.txt"
        trans.write_text(trans.read_text() + f"{utt} SOMETHING ELSE\n")
        return utt, trans.name, "duplicate transcript line"
    if case == "dangling_symlink":  # the link's target was moved away
        flac.unlink()
        flac.symlink_to(root / "moved-away.flac")
        return utt, flac.name, "broken symlink"
    if case == "symlink_loop":
        flac.unlink()
        flac.symlink_to(flac.name)
        return utt, flac.name, "broken symlink"
    if case in _BAD_VALUES:  # float samples (a WAV float file under a .flac name)
        audio, rate = sf.read(str(flac), dtype="float32")
        audio[len(audio) // 2] = _BAD_VALUES[case]
        sf.write(flac, audio, rate, format="WAV", subtype="FLOAT")
        return utt, flac.name, "invalid samples"
    if case == "list_without_audio":
        path = root / "train_split.txt"
        path.write_text(path.read_text() + "1001-10011-0099\n")
        return "1001-10011-0099", "train_split.txt", "utterance not in the corpus"
    raise ValueError(case)


CASES = ["unreadable", "truncated", "empty", "too_short", "wrong_rate", "missing_transcript",
         "alignment_length", "unknown_symbol", "class_out_of_range", "missing_alignment", "list_without_audio",
         "header_only", "duplicate_alignment", "duplicate_transcript", "dangling_symlink",
         "symlink_loop",
         *_BAD_VALUES]  # fmt: skip


def _config(base, root, tmp_path, **changes):
    extra = {"sample_rate_policy": "error"} | changes
    return dataclasses.replace(base, root=str(root), cache_dir=str(tmp_path / "cache"), **extra)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_naming_file_and_problem(case, corpus, tmp_path, tiny_data_config):
    utt, filename, problem = _damage(case, corpus)
    dm = LabelledDataModule(_config(tiny_data_config, corpus, tmp_path))
    with pytest.raises(DataError) as info:
        dm.prepare_data()
        dm.setup("fit")
    err = info.value
    assert err.problem == problem and err.utt_id == utt
    assert filename in str(err) and problem in str(err)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_skipped_counted_and_reported(
    case, corpus, tmp_path, tiny_data_config, caplog
):
    utt, filename, problem = _damage(case, corpus)
    dm = LabelledDataModule(_config(tiny_data_config, corpus, tmp_path, on_error="skip"))
    with caplog.at_level(logging.WARNING):
        dm.setup("fit")
    assert [(s.utt_id, s.problem) for s in dm.skipped] == [(utt, problem)]
    assert filename in dm.skipped[0].path
    used = {u for ds in dm.datasets.values() for u in ds.utt_ids}
    assert utt not in used and len(used) == 23 + (case == "list_without_audio")
    assert "skipped 1 bad input(s): 1 " + problem in caplog.text
    assert dm.issues.counts() == {problem: 1}


def test_skips_survive_a_cached_rerun(corpus, tmp_path, tiny_data_config):
    """A bad file recorded in the feature cache is reported again, without re-decoding."""
    utt, _, problem = _damage("truncated", corpus)
    cfg = _config(tiny_data_config, corpus, tmp_path, on_error="skip")
    first = LabelledDataModule(cfg)
    first.setup("fit")
    second = LabelledDataModule(cfg)
    second.setup("fit")
    assert [(s.utt_id, s.problem) for s in second.skipped] == [(utt, problem)]
    with pytest.raises(DataError, match="truncated"):
        LabelledDataModule(dataclasses.replace(cfg, on_error="error")).setup("fit")


@pytest.mark.parametrize("case", ["unreadable", "dangling_symlink", *_BAD_VALUES])
def test_pretraining_skips_bad_audio(case, corpus, tmp_path, tiny_data_config):
    utt, filename, problem = _damage(case, corpus)
    dm = PretrainDataModule(_config(tiny_data_config, corpus, tmp_path, on_error="skip"))
    dm.setup("fit")
    assert [(s.utt_id, s.problem) for s in dm.skipped] == [(utt, problem)]
    assert utt not in dm.datasets["train"].utt_ids + dm.datasets["val"].utt_ids
    assert torch.isfinite(dm.normalizer.mean).all() and torch.isfinite(dm.normalizer.std).all()
    with pytest.raises(DataError, match=problem) as info:
        PretrainDataModule(_config(tiny_data_config, corpus, tmp_path / "again")).setup("fit")
    assert filename in str(info.value)


def test_wrong_sample_rate_is_resampled_with_a_warning(corpus, tmp_path, tiny_data_config, caplog):
    utt, filename, _ = _damage("wrong_rate", corpus)
    dm = LabelledDataModule(
        _config(tiny_data_config, corpus, tmp_path, sample_rate_policy="resample")
    )
    with caplog.at_level(logging.WARNING):
        dm.setup("fit")
    assert not dm.skipped and utt in dm.datasets["train"].utt_ids + dm.datasets["dev"].utt_ids
    assert f"{filename}: resampled from 8000 Hz" in caplog.text


def test_root_without_librispeech_folders(tmp_path, tiny_data_config):
    (tmp_path / "notes").mkdir()
    (tmp_path / "README.txt").write_text("hello")
    with pytest.raises(DataError, match="not a LibriSpeech layout") as info:
        find_splits(tmp_path)
    assert str(tmp_path) in str(info.value) and "README.txt" in str(info.value)
    with pytest.raises(DataError, match="corpus root not found"):
        find_splits(tmp_path / "missing")
    dm = LabelledDataModule(
        dataclasses.replace(tiny_data_config, root=str(tmp_path), cache_dir=str(tmp_path / "c"))
    )
    with pytest.raises(DataError, match="not a LibriSpeech layout"):
        dm.setup("fit")
    wrong = dataclasses.replace(
        tiny_data_config, pretrain_splits=["train-clean-360"], cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(DataError, match=r"train-clean-360: split folder not found.*'synth-clean'"):
        PretrainDataModule(wrong).setup("fit")


def test_transcript_without_audio_is_reported(corpus):
    utt, flac = _victim(corpus)
    flac.unlink()
    with pytest.raises(
        DataError, match=f"transcript without audio.*{utt}|{utt}.*transcript without audio"
    ):
        scan_split(corpus, "synth-clean")


def test_header_only_flac_says_it_has_no_audio(corpus, tmp_path, tiny_data_config):
    _damage("header_only", corpus)
    with pytest.raises(DataError, match="no audio frames") as info:
        LabelledDataModule(_config(tiny_data_config, corpus, tmp_path)).setup("fit")
    assert "9223372036854775807" not in str(info.value)


def test_duplicate_lines_name_file_and_both_lines(corpus):
    utt, _, _ = _damage("duplicate_alignment", corpus)
    path = corpus / "converted_aligned_phones.txt"
    n = len(path.read_text().splitlines())
    with pytest.raises(DataError, match=f"duplicate alignment.*line {n} repeats {utt}"):
        read_alignments(path, None)
    _damage("duplicate_transcript", corpus)
    with pytest.raises(DataError, match=f"trans.txt \\[{utt}\\]: duplicate transcript line"):
        scan_split(corpus, "synth-clean")


def test_tab_separated_alignments_are_read(corpus, tmp_path, tiny_data_config):
    reference = read_alignments(corpus / "converted_aligned_phones.txt", None)
    path = corpus / "converted_aligned_phones.txt"
    path.write_text(path.read_text().replace(" ", "\t"))
    assert {u: v.tolist() for u, v in read_alignments(path, None).items()} == {
        u: v.tolist() for u, v in reference.items()
    }
    dm = LabelledDataModule(_config(tiny_data_config, corpus, tmp_path))
    dm.setup("fit")
    assert len({u for ds in dm.datasets.values() for u in ds.utt_ids}) == 24


def test_audio_in_another_format_is_named(corpus):
    utt, flac = _victim(corpus)
    audio, rate = sf.read(str(flac), dtype="float32")
    sf.write(flac.with_suffix(".wav"), audio, rate)
    flac.unlink()
    with pytest.raises(DataError, match=f"transcript without audio.*found {utt}.wav.*only .flac"):
        scan_split(corpus, "synth-clean")


def test_nan_features_cached_by_an_older_version_are_reextracted(
    corpus, tmp_path, tiny_data_config, monkeypatch
):
    """A cache written before samples were checked may hold NaN features for a NaN file (the
    shard's key is the same): they never reach the statistics; the shard is extracted again."""
    from speechattn.data import audio as audio_module

    cfg = _config(tiny_data_config, corpus, tmp_path, on_error="skip")
    utt, _, problem = _damage("nan_samples", corpus)
    with monkeypatch.context() as old:  # what the cache got before samples were checked
        old.setattr(audio_module, "_check_values", lambda *args: None)
        store = open_split(corpus, "synth-clean", extraction_settings(cfg), cfg.cache_root(),
                           Issues("skip"), workers=1, shard_size=cfg.shard_size, progress=False)  # fmt: skip
        shard = store.paths(int(store.shard[store.position[utt]])).npy  # raw() would refuse it
        assert not np.isfinite(np.load(shard)).all()
    with pytest.raises(DataError, match=f"non-finite features cached for {utt}.*rerun"):
        PretrainDataModule(cfg).setup("fit")
    dm = PretrainDataModule(cfg)
    dm.setup("fit")
    assert [(s.utt_id, s.problem) for s in dm.skipped] == [(utt, problem)]
    assert torch.isfinite(dm.normalizer.mean).all() and torch.isfinite(dm.normalizer.std).all()
