"""The built-in eSpeak corpus: layout, label/audio consistency, speakers, held-out sets, caching."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import soundfile as sf

from speechattn.data import synth, text
from speechattn.data.features import LogMel, num_frames
from speechattn.data.phones import IPA_TO_PHONE, PHONE_ID, PHONE_SET, SILENCE, ipa_to_phone

TINY_SPEAKERS, TINY_UTTERANCES = 4, 6  # the `tiny_corpus` fixture (tests/conftest.py)


def _alignments(root):
    out = {}
    for line in (root / "converted_aligned_phones.txt").read_text().splitlines():
        utt, *labels = line.split()
        out[utt] = np.array(labels, dtype=int)
    return out


def test_layout_is_librispeech(tiny_corpus):
    flacs = sorted((tiny_corpus / "synth-clean").glob("*/*/*.flac"))
    assert len(flacs) == TINY_SPEAKERS * TINY_UTTERANCES
    for path in flacs:
        speaker, chapter = path.parent.parent.name, path.parent.name
        assert path.stem.startswith(f"{speaker}-{chapter}-") and len(path.stem.split("-")[2]) == 4
        trans = path.parent / f"{speaker}-{chapter}.trans.txt"
        lines = dict(ln.split(" ", 1) for ln in trans.read_text().splitlines())
        assert lines[path.stem] == lines[path.stem].upper() and len(lines[path.stem].split()) >= 3
    for name in ("converted_aligned_phones.txt", "phone_set.txt", "train_split.txt", "test_split.txt",
                 "speakers.json", "corpus.json"):  # fmt: skip
        assert (tiny_corpus / name).is_file(), name
    info = json.loads((tiny_corpus / "corpus.json").read_text())
    assert info["generator_version"] == synth.GENERATOR_VERSION and info["utterances"] == len(flacs)


def test_audio_is_16k_mono_2_to_8_seconds(tiny_corpus):
    flacs = sorted((tiny_corpus / "synth-clean").glob("*/*/*.flac"))
    assert len(flacs) == TINY_SPEAKERS * TINY_UTTERANCES
    for path in flacs:
        info = sf.info(str(path))
        assert (info.samplerate, info.channels, info.format) == (16000, 1, "FLAC")
        assert 2.0 <= info.frames / 16000 <= 8.0


def test_labels_match_audio_length_and_phone_set(tiny_corpus):
    phone_set = (tiny_corpus / "phone_set.txt").read_text().split()
    assert phone_set == list(PHONE_SET) and len(phone_set) == 40 and phone_set[0] == SILENCE
    labels = _alignments(tiny_corpus)
    assert len(labels) == TINY_SPEAKERS * TINY_UTTERANCES
    seen = set()
    flacs = sorted((tiny_corpus / "synth-clean").glob("*/*/*.flac"))
    assert len(flacs) == len(labels)
    for path in flacs:
        lab = labels[path.stem]
        assert len(lab) == (sf.info(str(path)).frames - 400) // 160 + 1  # Kaldi snip-edges
        assert lab.min() >= 0 and lab.max() < len(phone_set)
        assert lab[0] == 0 and lab[-1] == 0  # leading / trailing silence
        seen.update(lab.tolist())
    assert len(seen) >= 25  # real phonetic variety, not a handful of classes


def test_labels_follow_the_audio(tiny_corpus):
    """Frames labelled silence are quieter than frames labelled as phones (alignment is real)."""
    labels = _alignments(tiny_corpus)
    mel = LogMel()
    gaps = []
    flacs = sorted((tiny_corpus / "synth-clean").glob("*/*/*.flac"))[:8]
    assert len(flacs) == 8
    for path in flacs:
        audio, _ = sf.read(str(path), dtype="float32")
        energy = mel(audio).mean(1).numpy()  # (T,)
        lab = labels[path.stem]
        assert len(energy) == len(lab) == num_frames(len(audio))
        vowels = np.isin(
            lab, [PHONE_ID[p] for p in ("AA", "AE", "AH", "AO", "EH", "IH", "IY", "EY", "AY")]
        )
        gaps.append(energy[vowels].mean() - energy[lab == 0].mean())
    assert min(gaps) > 2.0  # log-energy: vowels are far louder than silence


def test_every_speaker_in_both_splits(tiny_corpus):
    train = (tiny_corpus / "train_split.txt").read_text().split()
    test = (tiny_corpus / "test_split.txt").read_text().split()
    assert not set(train) & set(test)
    assert len(train) + len(test) == TINY_SPEAKERS * TINY_UTTERANCES
    by_split = defaultdict(set)
    for name, ids in (("train", train), ("test", test)):
        for u in ids:
            by_split[name].add(u.split("-")[0])
    assert by_split["train"] == by_split["test"] and len(by_split["train"]) == TINY_SPEAKERS
    assert 0.1 <= len(test) / (len(train) + len(test)) <= 0.3


def test_speaker_table(tiny_corpus):
    table = json.loads((tiny_corpus / "speakers.json").read_text())
    folders = {p.name for p in (tiny_corpus / "synth-clean").iterdir()}
    assert set(table) == folders
    voices = set()
    for spk, row in table.items():
        assert row["speaker_id"] == spk and row["utterances"] == TINY_UTTERANCES
        assert row["accent"] in synth.ACCENTS and row["variant"] in synth.VARIANTS
        assert 0 <= row["pitch"] <= 100 and 80 <= row["rate"] <= 450
        voices.add(row["voice"])
    assert len(voices) == len(table)  # distinct voice/accent pairs


def test_heldout_speakers_and_sentences_are_unseen(tiny_corpus, tmp_path):
    out = synth.build_corpus(
        tmp_path / "held", speakers=2, utterances_per_speaker=2, heldout=True, workers=1
    )
    main_table = json.loads((tiny_corpus / "speakers.json").read_text())
    held_table = json.loads((out / "speakers.json").read_text())
    assert (out / synth.SPLIT_HELDOUT).is_dir()
    assert not set(main_table) & set(held_table)
    assert not {r["voice"] for r in main_table.values()} & {r["voice"] for r in held_table.values()}
    # every sentence of a held-out corpus is in the held-out pool, which the main corpus never uses
    main = [
        ln.split(" ", 1)[1]
        for p in (tiny_corpus / "synth-clean").glob("*/*/*.trans.txt")
        for ln in p.read_text().splitlines()
    ]
    held = [
        ln.split(" ", 1)[1]
        for p in out.glob("*/*/*/*.trans.txt")
        for ln in p.read_text().splitlines()
    ]
    assert held and not set(main) & set(held)
    # pools are a fixed partition of the sentence space
    rng = np.random.default_rng(1)
    pools = [text.pool_of(text.sentence(rng)) for _ in range(400)]
    assert 0.1 < pools.count("heldout") / len(pools) < 0.3


def test_speaker_parameters_are_deterministic():
    a, b = synth.make_speakers(6, seed=3), synth.make_speakers(6, seed=3)
    assert a == b and synth.make_speakers(6, seed=4) != a


def test_frame_labels_take_the_phone_at_each_frame_centre():
    starts, classes = np.array([0, 500, 900]), np.array([5, 6, 0])
    lab = synth.frame_labels(starts, classes, 1200)
    assert len(lab) == (1200 - 400) // 160 + 1 == 6
    assert lab.tolist() == [5, 5, 6, 6, 6, 0]  # centres 200 360 520 680 840 1000
    assert synth.frame_labels(np.array([300]), np.array([7]), 800).tolist() == [0, 7, 7]


def test_phone_map_covers_the_phone_set():
    assert set(IPA_TO_PHONE.values()) == set(PHONE_SET)
    assert (
        ipa_to_phone("ˈaɪ") == "AY" and ipa_to_phone("ˌoʊ") == "OW" and ipa_to_phone("") == SILENCE
    )
    assert ipa_to_phone("ɑːː") == "AA"  # falls back to the form without length marks
    with pytest.raises(KeyError, match="no class"):
        ipa_to_phone("ǂ")


def test_ensure_embedded_corpus_builds_once_and_rebuilds_on_new_version(tmp_path, monkeypatch):
    calls = []
    real_build = synth.build_corpus

    def counting_build(out, *args, **kwargs):
        calls.append(out)
        return real_build(out, *args, **kwargs)

    monkeypatch.setattr(synth, "build_corpus", counting_build)
    first = synth.ensure_embedded_corpus(
        tmp_path, speakers=1, utterances_per_speaker=2, workers=1, progress=False
    )
    again = synth.ensure_embedded_corpus(
        tmp_path, speakers=1, utterances_per_speaker=2, workers=1, progress=False
    )
    assert first == again and len(calls) == 1
    assert len(list(first.glob("synth-clean/*/*/*.flac"))) == 2
    assert [p.name for p in (tmp_path / "corpus").iterdir()] == [first.name]  # no temp folder left

    monkeypatch.setattr(synth, "GENERATOR_VERSION", synth.GENERATOR_VERSION + 1)
    newer = synth.ensure_embedded_corpus(
        tmp_path, speakers=1, utterances_per_speaker=2, workers=1, progress=False
    )
    assert newer != first and len(calls) == 2
    assert (
        json.loads((newer / "corpus.json").read_text())["generator_version"]
        == synth.GENERATOR_VERSION
    )


def test_ensure_embedded_corpus_rebuilds_a_corrupt_record(tmp_path):
    first = synth.ensure_embedded_corpus(
        tmp_path, speakers=1, utterances_per_speaker=2, workers=1, progress=False
    )
    (first / "corpus.json").write_text("{broken")
    again = synth.ensure_embedded_corpus(
        tmp_path, speakers=1, utterances_per_speaker=2, workers=1, progress=False
    )
    assert again == first and json.loads((again / "corpus.json").read_text())["speakers"] == 1


def test_cli_writes_a_corpus(tmp_path):
    synth.main(["--out", str(tmp_path / "c"), "--speakers", "1", "--utterances-per-speaker", "2",
                "--workers", "1", "--no-progress"])  # fmt: skip
    assert len(list((tmp_path / "c" / "synth-clean").glob("*/*/*.flac"))) == 2


def test_the_corpus_is_the_same_for_any_worker_count_and_history(tmp_path):
    """eSpeak NG carries state from one utterance to the next in a process: each speaker is
    spoken in a fresh process, so neither the worker count nor what the building process spoke
    before changes a byte of the corpus (workers forked from a process that never spoke, or
    from a server once it has)."""
    from speechattn.data.espeak import Espeak, VoiceSettings

    build = (
        "import sys; from speechattn.data.synth import build_corpus; "
        "build_corpus(sys.argv[1], speakers=3, utterances_per_speaker=2, workers=2)"
    )
    subprocess.run([sys.executable, "-c", build, str(tmp_path / "two")], check=True)
    Espeak.get().synthesize("this process has spoken before", VoiceSettings(voice="en"))
    one = synth.build_corpus(tmp_path / "one", speakers=3, utterances_per_speaker=2, workers=1)
    two = tmp_path / "two"
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
