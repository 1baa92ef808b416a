"""The LibriSpeech-layout reader on the built-in corpus (same code path as real LibriSpeech)."""

from __future__ import annotations

import soundfile as sf

from speechattn.data.errors import Issues
from speechattn.data.librispeech import (
    LabelFiles,
    find_splits,
    read_alignments,
    read_phone_set,
    read_split_list,
    scan_split,
)


def test_find_splits(tiny_corpus):
    assert find_splits(tiny_corpus) == ["synth-clean"]


def test_scan_split_yields_utterances(tiny_corpus):
    utts = scan_split(tiny_corpus, "synth-clean", with_info=True)
    assert len(utts) == 24 and [u.utt_id for u in utts] == sorted(u.utt_id for u in utts)
    for u in utts:
        speaker, chapter, _ = u.utt_id.split("-")
        assert (u.speaker, u.chapter, u.split) == (speaker, chapter, "synth-clean")
        assert u.path.is_absolute() and u.path.name == f"{u.utt_id}.flac"
        assert u.transcript and u.transcript == u.transcript.upper()
        assert u.sample_rate == 16000 and u.num_samples == sf.info(str(u.path)).frames
        assert 2.0 <= u.duration <= 8.0 and u.size == u.path.stat().st_size
    assert {u.speaker for u in utts} == {"1001", "1002", "1003", "1004"}


def test_scan_without_info_skips_headers(tiny_corpus):
    u = scan_split(tiny_corpus, "synth-clean")[0]
    assert u.num_samples is None and u.duration is None


def test_label_files(tiny_corpus):
    files = LabelFiles(tiny_corpus)
    phone_set = files.load_phone_set(None)
    assert phone_set == read_phone_set(tiny_corpus / "phone_set.txt") and len(phone_set) == 40
    labels = read_alignments(files.path("converted_aligned_phones.txt"), phone_set)
    train = read_split_list(tiny_corpus / "train_split.txt")
    test = read_split_list(tiny_corpus / "test_split.txt")
    assert set(labels) == set(train) | set(test)
    assert all(v.dtype.kind == "i" and v.max() < 40 for v in labels.values())
    wanted = set(test)
    assert (
        set(read_alignments(files.path("converted_aligned_phones.txt"), phone_set, wanted=wanted))
        == wanted
    )


def test_alignments_with_symbols_and_without_a_phone_set(tmp_path):
    (tmp_path / "a.txt").write_text("1-2-0000 sil AA AA sil\n1-2-0001 3 3 1\n")
    labels = read_alignments(tmp_path / "a.txt", ["sil", "AA", "B", "C"])
    assert labels["1-2-0000"].tolist() == [0, 1, 1, 0] and labels["1-2-0001"].tolist() == [3, 3, 1]
    assert LabelFiles(tmp_path).load_phone_set(41) == [
        str(i) for i in range(41)
    ]  # CPC: no phone_set.txt
    assert read_alignments(tmp_path / "a.txt", None, Issues("skip"), wanted={"1-2-0001"})[
        "1-2-0001"
    ].tolist() == [3, 3, 1]
