"""The s3prl 0.4.18 compatibility shims, each against what it replaces, and the task layouts
made from the built-in corpus, read by s3prl's own dataset code."""

from __future__ import annotations

import argparse
import io
import pickle
import re

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio

pytest.importorskip("s3prl.upstream.interfaces")

from speechattn.data.errors import DataError  # noqa: E402
from speechattn.superb import compat  # noqa: E402
from speechattn.superb.configs import PAPER, QUICK, task_config  # noqa: E402
from speechattn.superb.prepare import (  # noqa: E402
    phoneme_sequence,
    prepare,
    speech_commands_split,
)


@pytest.fixture(scope="module", autouse=True)
def shims():
    return compat.install()


def test_every_shim_names_what_it_bridges():
    names = [s.name for s in compat.SHIMS]
    assert len(set(names)) == len(names) == 7
    for shim in compat.SHIMS:  # the s3prl release it serves, and the release that removed it
        assert "s3prl 0.4.18" in shim.bridges, shim
        assert re.search(r"(torch|torchaudio|huggingface_hub|Python) \d|wheel", shim.bridges)
    assert compat.install() == []  # idempotent: nothing left to install


def test_set_audio_backend_and_hf_names_exist():
    import huggingface_hub

    torchaudio.set_audio_backend("sox_io")  # s3prl's run_downstream.main calls this
    with pytest.raises(compat.ShimError, match="drop --push_to_hf_hub"):
        huggingface_hub.HfFolder.get_token()
    with pytest.raises(compat.ShimError, match="Repository"):
        huggingface_hub.Repository("x")


def test_sox_effects_shim_matches_mean_resample_and_gain(tmp_path):
    from torchaudio.sox_effects import apply_effects_file

    g = np.random.default_rng(0)
    stereo = (0.2 * g.standard_normal((8000, 2))).astype(np.float32)
    sf.write(tmp_path / "a.wav", stereo, 8000, subtype="FLOAT")
    effects = [["channels", "1"], ["rate", "16000"], ["gain", "-3.0"]]  # speech_commands'
    wav, rate = apply_effects_file(str(tmp_path / "a.wav"), effects)
    mono = torch.from_numpy(stereo.mean(1))[None]
    want = torchaudio.functional.resample(mono, 8000, 16000) * 10 ** (-3 / 20)
    assert rate == 16000 and wav.shape == (1, 16000)
    torch.testing.assert_close(wav, want)
    with pytest.raises(compat.ShimError, match="only channels 1, rate R and gain"):
        apply_effects_file(str(tmp_path / "a.wav"), [["reverb", "50"]])


def test_load_and_info_read_what_soundfile_reads(tmp_path):
    data = (0.3 * np.random.default_rng(1).standard_normal(5000)).astype(np.float32)
    sf.write(tmp_path / "b.flac", data, 16000, subtype="PCM_16")
    ref, _ = sf.read(tmp_path / "b.flac", dtype="float32")
    wav, rate = compat.load(tmp_path / "b.flac")
    assert rate == 16000 and wav.shape == (1, 5000)
    assert torch.equal(wav[0], torch.from_numpy(ref))
    part, _ = compat.load(tmp_path / "b.flac", frame_offset=100, num_frames=50)
    assert torch.equal(part[0], torch.from_numpy(ref[100:150]))
    meta = compat.info(tmp_path / "b.flac")
    assert (meta.sample_rate, meta.num_frames, meta.num_channels) == (16000, 5000, 1)
    assert meta.bits_per_sample == 16
    (tmp_path / "bad.wav").write_bytes(b"RIFF....")
    with pytest.raises(DataError, match="bad.wav: unreadable audio"):
        compat.load(tmp_path / "bad.wav")


class NotAllowed:
    pass


def test_runner_checkpoints_load_weights_only_with_the_allow_list():
    buffer = io.BytesIO()
    torch.save({"Args": argparse.Namespace(mode="train", lr=1e-4), "Step": 3}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # s3prl's torch.load(path) default
    assert state["Args"].mode == "train" and state["Step"] == 3
    buffer = io.BytesIO()
    torch.save({"Args": NotAllowed()}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="NotAllowed"):
        torch.load(buffer, weights_only=True)  # anything else stays refused


def test_catalyst_wrapper_splits_one_draw_between_ranks():
    from catalyst.data.sampler import DistributedSamplerWrapper  # what speech_commands imports

    weights = [1.0] * 10

    def draw(rank: int) -> list[int]:
        torch.manual_seed(0)  # every rank seeds alike, so the wrapped sampler draws alike
        sampler = torch.utils.data.WeightedRandomSampler(weights, 10)
        wrapper = DistributedSamplerWrapper(sampler, num_replicas=2, rank=rank, shuffle=False)
        return list(wrapper)

    torch.manual_seed(0)
    full = list(torch.utils.data.WeightedRandomSampler(weights, 10))
    assert draw(0) == full[0::2] and draw(1) == full[1::2]


def test_configs_paper_and_quick():
    assert set(PAPER) == set(QUICK) == {"speech_commands", "voxceleb1", "ctc"}
    ks = task_config("speech_commands")
    assert ks["optimizer"]["lr"] == 1e-4 and ks["runner"]["total_steps"] == 200_000
    assert task_config("ctc")["optimizer"]["lr"] == 1e-2
    assert task_config("voxceleb1")["runner"]["gradient_accumulate_steps"] == 4
    quick = task_config(
        "voxceleb1", quick=True, overrides={"downstream_expert.datarc.file_path": "x"}
    )
    assert (
        quick["runner"]["total_steps"] == 300
        and quick["downstream_expert"]["datarc"]["file_path"] == "x"
    )
    assert PAPER["voxceleb1"]["downstream_expert"]["datarc"].get("file_path") is None  # untouched
    with pytest.raises(ValueError, match="-d asr: speechattn ships SUPERB configs for"):
        task_config("asr")


def test_speech_commands_layout_follows_s3prls_split(tiny_corpus, tmp_path):
    from s3prl.downstream.speech_commands.dataset import CLASSES
    from s3prl.downstream.speech_commands.expert import split_dataset

    out = prepare("speech_commands", tiny_corpus, tmp_path / "ks", repeats=1)
    train, dev = split_dataset(out / "train")  # s3prl's own split
    speaker = lambda path: path.name.split("_nohash_")[0]  # noqa: E731
    assert train and dev and not {speaker(p) for _, p in train} & {speaker(p) for _, p in dev}
    assert {c for c, _ in train} >= set(CLASSES[:10])
    assert all(speech_commands_split(speaker(p)) == "train" for _, p in train)
    test_classes = {p.name for p in (out / "test").iterdir()}
    assert test_classes == set(CLASSES)
    wav, rate = sf.read(next((out / "test" / "yes").glob("*.wav")))
    assert rate == 16000 and wav.shape == (16000,) and 0 < np.abs(wav).max() <= 1


def test_voxceleb1_and_ctc_layouts_are_read_by_s3prl(tiny_corpus, tmp_path):
    from s3prl.downstream.ctc.text import load_text_encoder
    from s3prl.downstream.voxceleb1 import dataset as vox

    from speechattn.data.librispeech import read_alignments, read_phone_set, read_split_list
    from speechattn.superb.libriphone import LibriPhoneDataset

    sid = prepare("voxceleb1", tiny_corpus, tmp_path / "sid")
    compat.set_voxceleb1_cache(tmp_path / "exp")
    test = vox.SpeakerClassifiDataset("test", sid, sid / "veri_test_class.txt")
    assert len(test) == len(read_split_list(tiny_corpus / "test_split.txt"))
    wav, label, _ = test[0]
    assert 0 <= label < 4 and wav.ndim == 1
    assert (tmp_path / "exp" / ".voxceleb1_cache" / "test.pkl").is_file()  # not in site-packages

    pr = prepare("ctc", tiny_corpus, tmp_path / "pr")
    tokenizer = load_text_encoder("word", str(pr / "phoneme.txt"))
    data = LibriPhoneDataset("test.csv", tokenizer, 1, [str(pr / "lexicon.txt")], str(pr))
    phone_set = read_phone_set(tiny_corpus / "phone_set.txt")
    labels = read_alignments(tiny_corpus / "converted_aligned_phones.txt", phone_set)
    path, target = data[0]
    utt = path.rsplit("/", 1)[1].split(".")[0]
    assert tokenizer.decode(target) == " ".join(phoneme_sequence(labels[utt], phone_set))
    assert phoneme_sequence(np.array([0, 3, 3, 0, 3, 7, 7]), phone_set) == ["AH", "AH", "B"]
    (pr / "bad.csv").write_text("wav_path,transcription\nx.flac,no-such-word\n")
    with pytest.raises(DataError, match=r"bad.csv: line 2: words \['no-such-word'\]"):
        LibriPhoneDataset("bad.csv", tokenizer, 1, [str(pr / "lexicon.txt")], str(pr))


def test_keywords_sound_the_same_whatever_this_process_spoke_before(tiny_corpus, tmp_path):
    """eSpeak NG keeps state between calls in a process: the keywords are spoken in a fresh
    one, so a second preparation after other speech writes the same files."""
    from speechattn.data.espeak import Espeak, VoiceSettings

    first = prepare("speech_commands", tiny_corpus, tmp_path / "a", repeats=1)
    Espeak.get().synthesize("this process has spoken", VoiceSettings(voice="en"))
    again = prepare("speech_commands", tiny_corpus, tmp_path / "b", repeats=1)
    wavs = sorted(p.relative_to(first) for p in first.rglob("*.wav"))
    assert wavs and wavs == sorted(p.relative_to(again) for p in again.rglob("*.wav"))
    for name in wavs:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
