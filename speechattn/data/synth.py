"""Built-in multi-speaker corpus synthesised with eSpeak NG (docs/data.md).

    python -m speechattn.data.synth --out DIR [--speakers 24] [--utterances-per-speaker 25]
                                    [--seed 0] [--heldout] [--workers N]

writes a LibriSpeech-layout corpus with CPC labels (docs/data.md, "Built-in corpus"). A speaker
is an eSpeak voice variant x accent x prosody plus a fixed "channel" (tilt, gain, noise);
every utterance jitters pitch, rate, gain and SNR.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from speechattn.data import text as textgen
from speechattn.data.espeak import fresh_engine_pool
from speechattn.data.features import HOP_LENGTH, SAMPLE_RATE, WIN_LENGTH, num_frames
from speechattn.data.phones import PHONE_SET, phone_id
from speechattn.errors import ConfigError
from speechattn.utils import default_cache_root, digest, progress_bar

log = logging.getLogger(__name__)

GENERATOR_VERSION = 3  # bump whenever the output changes: cached corpora then rebuild
SPLIT_MAIN, SPLIT_HELDOUT = "synth-clean", "synth-heldout"
MIN_SECONDS, MAX_SECONDS = 2.0, 8.0
TEST_SHARE = 0.2
CHAPTERS_PER_SPEAKER = 2
# per-utterance variation of the channel (so utterance statistics alone do not give the speaker)
UTT_TILT_JITTER, UTT_EQ_DB, UTT_GAIN_DB, UTT_SNR_DB = 0.15, 4.0, 4.0, 5.0
STALE_BUILD_SECONDS = 3600  # temporary build folders older than this belong to killed builds

# eSpeak NG English accents (espeak-ng-data/lang/gmw) and human-sounding voice variants (voices/!v).
ACCENTS = (
    "en",
    "en-us",
    "en-gb-x-rp",
    "en-029",
    "en-gb-scotland",
    "en-us-nyc",
    "en-gb-x-gbcwmd",
    "en-gb-x-gbclan",
)
VARIANTS = (
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m7",
    "m8",
    "f1",
    "f2",
    "f3",
    "f4",
    "f5",
    "Alex",
    "Alicia",
    "Andrea",
    "Andy",
    "Annie",
    "Denis",
    "Gene",
    "Jacky",
    "Lee",
    "Michael",
    "Mike",
    "antonio",
    "aunty",
    "belinda",
    "boris",
    "ed",
    "iven",
    "john",
    "linda",
    "max",
    "norbert",
    "quincy",
    "robert",
    "steph",
    "travis",
)


@dataclass(frozen=True)
class Speaker:
    """One synthetic speaker: eSpeak voice + prosody + a fixed channel."""

    speaker_id: str
    accent: str
    variant: str
    pitch: int  # eSpeak base pitch 0..100
    pitch_range: int  # eSpeak intonation range 0..100
    rate: int  # words per minute
    tilt: float  # channel: y[n] = x[n] + tilt * x[n-1]
    gain_db: float
    snr_db: float  # additive white noise level

    @property
    def voice(self) -> str:
        return f"{self.accent}+{self.variant}"


def make_speakers(count: int, seed: int = 0, heldout: bool = False) -> list[Speaker]:
    """`count` speakers; main corpora take voice/accent pairs from the front of a seeded
    permutation, held-out corpora from the back, so the two never share a pair."""
    pairs = [(v, a) for v in VARIANTS for a in ACCENTS]
    if count > len(pairs) // 2:
        raise ConfigError(f"at most {len(pairs) // 2} speakers per corpus, asked for {count}")
    order = np.random.default_rng([seed, 7919]).permutation(len(pairs))
    chosen = order[::-1][:count] if heldout else order[:count]
    speakers = []
    for i, k in enumerate(chosen):
        variant, accent = pairs[int(k)]
        rng = np.random.default_rng([seed, int(heldout), i, 104729])
        speakers.append(
            Speaker(
                str((7001 if heldout else 1001) + i),
                accent,
                variant,
                pitch=int(rng.integers(30, 71)),
                pitch_range=int(rng.integers(30, 81)),
                rate=int(rng.integers(140, 201)),
                tilt=round(float(rng.uniform(-0.45, 0.45)), 3),
                gain_db=round(float(rng.uniform(-6.0, 0.0)), 2),
                snr_db=round(float(rng.uniform(28.0, 42.0)), 1),
            )
        )
    return speakers


def frame_labels(starts: np.ndarray, classes: np.ndarray, num_samples: int) -> np.ndarray:
    """Phone id per 10 ms frame, the one active at the frame's centre: starts (P,) start
    samples (non-decreasing), classes (P,) each lasting until the next start ->
    (num_frames(num_samples),) int64, silence (0) before the first start."""
    centres = np.arange(num_frames(num_samples)) * HOP_LENGTH + WIN_LENGTH // 2
    idx = np.searchsorted(starts, centres, side="right") - 1
    return np.where(idx >= 0, classes[np.clip(idx, 0, None)], 0).astype(np.int64)


def random_eq(
    audio: np.ndarray, rng: np.random.Generator, depth_db: float, taps: int = 64
) -> np.ndarray:
    """Colour `audio` with a random smooth EQ: gains of +-`depth_db` at 6 log-spaced
    frequencies, interpolated, applied as a linear-phase FIR (length preserved)."""
    if depth_db <= 0:
        return audio
    freqs = np.fft.rfftfreq(taps, 1 / SAMPLE_RATE)  # (taps/2 + 1,)
    anchors = np.geomspace(100, SAMPLE_RATE / 2, 6)
    gains_db = np.interp(
        np.log(np.maximum(freqs, 50)), np.log(anchors), rng.uniform(-depth_db, depth_db, 6)
    )
    h = np.fft.irfft(10 ** (gains_db / 20), taps)  # zero-phase impulse response
    h = np.roll(h, taps // 2) * np.hanning(taps)  # causal, windowed: linear phase
    return np.convolve(audio, h.astype(np.float32), mode="same").astype(np.float32)


_RESAMPLER = None


def _resample(audio: np.ndarray, source_rate: int) -> np.ndarray:
    global _RESAMPLER
    import torch
    import torchaudio

    if _RESAMPLER is None or _RESAMPLER[0] != source_rate:
        _RESAMPLER = (source_rate, torchaudio.transforms.Resample(source_rate, SAMPLE_RATE))
    with torch.no_grad():
        return _RESAMPLER[1](torch.from_numpy(audio)[None])[0].numpy()


def _synth_speaker(task: tuple[Speaker, int, int, int, bool, Path]) -> list[dict]:
    """The utterances of (speaker, its index, their count, seed, held out, split folder), in
    order, their chapters alternating (run in a fresh process: `build_corpus`)."""
    spk, speaker_index, count, seed, heldout, split_dir = task
    out = []
    for u in range(count):
        k, which = divmod(u, CHAPTERS_PER_SPEAKER)  # utterance k of chapter `which`
        chapter = int(spk.speaker_id) * 10 + 1 + which
        rng = np.random.default_rng([seed, int(heldout), speaker_index, chapter, k])
        utt_id = f"{spk.speaker_id}-{chapter}-{k:04d}"
        out.append(_synth_one(spk, utt_id, rng, heldout, split_dir / spk.speaker_id / str(chapter)))
    return out


def _synth_one(
    spk: Speaker, utt_id: str, rng: np.random.Generator, heldout: bool, folder: Path
) -> dict:
    """Synthesise, post-process and write one FLAC into `folder`: its id, text, labels, length."""
    import soundfile as sf

    from speechattn.data.espeak import Espeak, VoiceSettings

    engine = Espeak.get()
    pool = "heldout" if heldout else "main"
    for _attempt in range(40):
        rate = int(spk.rate * rng.uniform(0.92, 1.08))
        target = rng.uniform(MIN_SECONDS + 0.5, MAX_SECONDS - 1.0)
        words = max(3, int(target * rate / 60 * 0.85))
        text = textgen.utterance_text(rng, max(3, words - 2), words + 2)
        while textgen.pool_of(text) != pool:  # main and held-out corpora never share a sentence
            text = textgen.utterance_text(rng, max(3, words - 2), words + 2)
        pitch = int(np.clip(spk.pitch + rng.integers(-4, 5), 0, 100))
        pitch_range = int(np.clip(spk.pitch_range + rng.integers(-6, 7), 0, 100))
        raw, events = engine.synthesize(
            text, VoiceSettings(spk.voice, rate=rate, pitch=pitch, pitch_range=pitch_range)
        )
        lead = int(rng.uniform(0.08, 0.35) * SAMPLE_RATE)
        tail = int(rng.uniform(0.05, 0.25) * SAMPLE_RATE)
        speech = _resample(raw.astype(np.float32) / 32768.0, engine.sample_rate)
        n = lead + len(speech) + tail
        if MIN_SECONDS <= n / SAMPLE_RATE <= MAX_SECONDS:
            break
    else:
        msg = f"{utt_id}: could not synthesise a {MIN_SECONDS}-{MAX_SECONDS} s utterance"
        raise RuntimeError(msg)
    # channel: the speaker's tilt (jittered), a random per-utterance EQ and gain, then noise
    tilt = spk.tilt + rng.uniform(-UTT_TILT_JITTER, UTT_TILT_JITTER)
    speech = speech + tilt * np.concatenate([[0.0], speech[:-1]]).astype(np.float32)
    speech = random_eq(speech, rng, UTT_EQ_DB)
    audio = np.zeros(n, np.float32)
    audio[lead : lead + len(speech)] = speech
    audio *= 10 ** ((spk.gain_db + rng.uniform(-UTT_GAIN_DB, UTT_GAIN_DB)) / 20)
    rms = float(np.sqrt(np.mean(audio[lead : lead + len(speech)] ** 2) + 1e-12))
    snr = spk.snr_db + rng.uniform(-UTT_SNR_DB, UTT_SNR_DB)
    audio += rng.standard_normal(n).astype(np.float32) * rms * 10 ** (-snr / 20)
    audio = np.clip(audio, -1.0, 1.0 - 1 / 32768)
    scale = SAMPLE_RATE / engine.sample_rate
    starts = np.array([lead + round(s * scale) for s, _ in events], dtype=np.int64)
    classes = np.array([phone_id(name) for _, name in events], dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    labels = frame_labels(starts[order], classes[order], n)
    folder.mkdir(parents=True, exist_ok=True)
    sf.write(folder / f"{utt_id}.flac", audio, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
    return {"utt_id": utt_id, "text": text, "labels": labels, "num_samples": n}


def corpus_params(speakers: int, utterances_per_speaker: int, seed: int, heldout: bool) -> dict:
    """The parameters recorded in `corpus.json` (a corpus is reused only if they match)."""
    return {
        "generator_version": GENERATOR_VERSION,
        "speakers": speakers,
        "utterances_per_speaker": utterances_per_speaker,
        "seed": seed,
        "heldout": heldout,
        "sample_rate": SAMPLE_RATE,
        "num_phones": len(PHONE_SET),
    }


def build_corpus(
    out: str | Path,
    speakers: int = 24,
    utterances_per_speaker: int = 25,
    seed: int = 0,
    heldout: bool = False,
    workers: int | None = None,
    progress: bool = False,
) -> Path:
    """Write a corpus into `out` (created; existing corpus files are overwritten). Returns `out`."""
    if speakers < 1 or utterances_per_speaker < 2:
        raise ConfigError("need at least 1 speaker and 2 utterances per speaker (train and test)")
    start = time.perf_counter()
    out = Path(out)
    split = SPLIT_HELDOUT if heldout else SPLIT_MAIN
    split_dir = out / split
    split_dir.mkdir(parents=True, exist_ok=True)
    table = make_speakers(speakers, seed, heldout)
    # one task per speaker, its utterances in order, each in a fresh process: the same corpus
    # for any number of workers (`espeak.fresh_engine_pool`)
    tasks = [(s, i, utterances_per_speaker, seed, heldout, split_dir) for i, s in enumerate(table)]
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    results: list[dict] = []
    total = len(tasks) * utterances_per_speaker
    with progress_bar(total, f"synthesising {split}", progress) as advance:
        with fresh_engine_pool(workers, __name__) as pool:
            for spoken in pool.imap_unordered(_synth_speaker, tasks):
                results.extend(spoken)
                advance(len(spoken))
    results.sort(key=lambda r: r["utt_id"])
    params = corpus_params(speakers, utterances_per_speaker, seed, heldout)
    _write_metadata(out, split, table, results, seed, params)
    seconds = sum(r["num_samples"] for r in results) / SAMPLE_RATE
    log.info(
        "built %s: %d speakers, %d utterances, %.1f min of speech in %.1f s",
        out,
        len(table),
        len(results),
        seconds / 60,
        time.perf_counter() - start,
    )
    return out


def _write_metadata(
    out: Path, split: str, table: list[Speaker], results: list[dict], seed: int, params: dict
) -> None:
    by_chapter: dict[Path, list[str]] = {}
    for r in results:
        spk, chapter, _ = r["utt_id"].split("-")
        line = f"{r['utt_id']} {textgen.normalise_transcript(r['text'])}"
        path = out / split / spk / chapter / f"{spk}-{chapter}.trans.txt"
        by_chapter.setdefault(path, []).append(line)
    for path, lines in by_chapter.items():
        path.write_text("\n".join(sorted(lines)) + "\n")
    with open(out / "converted_aligned_phones.txt", "w") as f:
        for r in results:
            f.write(r["utt_id"] + " " + " ".join(map(str, r["labels"].tolist())) + "\n")
    (out / "phone_set.txt").write_text("\n".join(PHONE_SET) + "\n")
    rng = np.random.default_rng([seed, 15485863])
    train, test = [], []
    for spk in table:
        ids = sorted(r["utt_id"] for r in results if r["utt_id"].startswith(spk.speaker_id + "-"))
        ids = [ids[i] for i in rng.permutation(len(ids))]
        n_test = min(len(ids) - 1, max(1, round(TEST_SHARE * len(ids))))
        test += ids[:n_test]
        train += ids[n_test:]
    (out / "train_split.txt").write_text("\n".join(sorted(train)) + "\n")
    (out / "test_split.txt").write_text("\n".join(sorted(test)) + "\n")
    counts = Counter(r["utt_id"].split("-")[0] for r in results)
    speakers = {s.speaker_id: {**asdict(s), "voice": s.voice, "split": split} for s in table}
    for speaker_id, record in speakers.items():
        record["utterances"] = counts[speaker_id]
    (out / "speakers.json").write_text(json.dumps(speakers, indent=2) + "\n")
    hours = round(sum(r["num_samples"] for r in results) / SAMPLE_RATE / 3600, 4)
    info = {**params, "split": split, "utterances": len(results), "hours": hours}
    (out / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")


def _params_match(folder: Path, params: dict) -> bool:
    try:
        info = json.loads((folder / "corpus.json").read_text())
    except (OSError, ValueError):
        return False
    return all(info.get(k) == v for k, v in params.items())


def ensure_embedded_corpus(
    cache_root: str | Path | None = None,
    speakers: int = 24,
    utterances_per_speaker: int = 25,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Path of the built-in corpus in `cache_root/corpus/`, built on first use: in a temporary
    sibling folder renamed into place, so an interrupted build leaves nothing half-written; its
    name hashes the parameters, and `corpus.json` is checked again before reuse."""

    params = corpus_params(speakers, utterances_per_speaker, seed, False)
    cache_root = default_cache_root() if cache_root is None else cache_root
    parent = Path(cache_root).expanduser() / "corpus"
    final = parent / f"embedded-v{GENERATOR_VERSION}-{digest(params, length=10)}"
    if _params_match(final, params):
        return final
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{final.name}.tmp-*"):  # left by a build that was killed
        if time.time() - stale.stat().st_mtime > STALE_BUILD_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)
    log.info("building the built-in corpus into %s (first use)", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        build_corpus(tmp, speakers, utterances_per_speaker, seed, False, workers, progress)
        if final.exists():  # stale (parameter mismatch) or built concurrently
            if _params_match(final, params):
                return final
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _params_match(final, params):  # lost a race to a broken build: should not happen
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone where it was renamed
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechattn.data.synth", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (created)")
    parser.add_argument("--speakers", type=int, default=24)
    parser.add_argument("--utterances-per-speaker", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heldout", action="store_true", help="unseen speakers and sentences (synth-heldout/)"
    )
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_corpus(
        args.out,
        args.speakers,
        args.utterances_per_speaker,
        args.seed,
        args.heldout,
        args.workers,
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    main()
