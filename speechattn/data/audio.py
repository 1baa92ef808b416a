"""Decode one audio file with every check of docs/data.md, "Bad input": `load_audio` returns
float32 mono at 16 kHz (resampling and channel averaging noted in `AudioResult.notes`) or
raises `DataError` naming the file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from speechattn.data.errors import DataError
from speechattn.data.utterances import Segment

SAMPLE_RATE = 16000
# Float audio is nominally within +-1; a peak 40 dB over full scale is a file written at another
# scale (or garbage), whose features would dwarf every other utterance's in the statistics.
MAX_PEAK = 100.0
# A segment may end this much past its file (lhotse's tolerance for a duration mismatch).
SEGMENT_SLACK_S = 0.025


@dataclass
class AudioResult:
    audio: np.ndarray  # float32 (N,) at SAMPLE_RATE
    notes: list[str] = field(default_factory=list)  # e.g. "resampled from 8000 Hz"


def load_audio(
    path: str | Path,
    sample_rate_policy: str = "resample",
    min_samples: int = 1,
    utt_id: str | None = None,
    segment: Segment | None = None,
) -> AudioResult:
    """Decode `path` (anything libsndfile reads), or its `segment`, into float32 mono at 16 kHz;
    other rates are resampled (noted) or, with `sample_rate_policy="error"`, refused. Fewer
    than `min_samples` samples is "too short"; errors name `utt_id`."""
    import soundfile as sf

    path = Path(path)
    bad = partial(DataError, path, utt_id=utt_id)  # bad(problem, detail): the error to raise
    try:
        size = path.stat().st_size
    except OSError as e:
        raise bad("missing audio file", str(e)) from None
    if size == 0:
        raise bad("empty audio", "the file has 0 bytes")
    try:
        info = sf.info(str(path))
    except (RuntimeError, OSError) as e:  # LibsndfileError is a RuntimeError
        raise bad("unreadable audio", _short(e)) from None
    start, frames = (0, -1) if segment is None else _segment_samples(segment, info, bad)
    try:
        audio, rate = sf.read(
            str(path), frames=frames, start=start, dtype="float32", always_2d=True
        )  # (N, C)
    except (RuntimeError, OSError) as e:
        if flac_audio_bytes(path) == 0:
            # libsndfile reports an unknown length as 2**63 - 1 samples; say what is there
            raise bad("empty audio", "a FLAC header with no audio frames after it") from None
        detail = f"header says {info.frames} samples; {_short(e)}"
        raise bad("truncated or corrupt audio", detail) from None
    expected = info.frames - start if frames < 0 else frames
    if info.frames > 0 and audio.shape[0] < expected:
        detail = f"header says {expected} samples from sample {start}, decoded {audio.shape[0]}"
        raise bad("truncated or corrupt audio", detail)
    if audio.shape[0] == 0:
        raise bad("empty audio", "0 samples")
    _check_values(audio, bad)
    if segment is not None and segment.channel is not None:
        audio = audio[:, segment.channel : segment.channel + 1]
    notes = [f"averaged {audio.shape[1]} channels"] if audio.shape[1] > 1 else []
    audio = audio.mean(axis=1) if audio.shape[1] > 1 else audio[:, 0]
    if rate != SAMPLE_RATE:
        if sample_rate_policy == "error":
            fix = "data.sample_rate_policy=resample converts it"
            raise bad("wrong sample rate", f"{rate} Hz, expected {SAMPLE_RATE} Hz ({fix})")
        audio = resample(audio, rate)
        notes.append(f"resampled from {rate} Hz")
    if (n := audio.shape[0]) < min_samples:
        detail = f"{n} samples ({n / SAMPLE_RATE:.3f} s), need at least {min_samples}"
        raise bad("too short", detail)
    return AudioResult(np.ascontiguousarray(audio, dtype=np.float32), notes)


def _segment_samples(segment: Segment, info, bad: Callable[..., DataError]) -> tuple[int, int]:
    """(first sample, sample count) of `segment` in the file `info` describes; a segment that
    ends past the file (beyond `SEGMENT_SLACK_S`) or names a channel it lacks is bad input."""
    rate = info.samplerate
    start, frames = round(segment.start * rate), round(segment.duration * rate)
    if segment.channel is not None and not 0 <= segment.channel < info.channels:
        detail = f"the segment reads channel {segment.channel}; the file has {info.channels}"
        raise bad("no such channel", detail)
    missing = start + frames - info.frames
    if segment.start < 0 or missing > SEGMENT_SLACK_S * rate:
        detail = f"{segment.start:g} s + {segment.duration:g} s, the file holds"
        detail += f" {info.frames / rate:g} s: the manifest does not match this file"
        raise bad("segment outside the audio", detail)
    return start, min(frames, info.frames - start)


def _check_values(audio: np.ndarray, bad: Callable[..., DataError]) -> None:
    """Refuse NaN, infinite or absurdly large samples in `audio` (N, C) as decoded: one makes
    the file's features, and the corpus statistics, NaN or inf."""
    finite = np.isfinite(audio)
    if not finite.all():
        n_nan, first = int(np.isnan(audio).sum()), int(np.argmin(finite.all(axis=1)))
        detail = f"{n_nan} NaN and {int((~finite).sum()) - n_nan} infinite sample(s), the first"
        raise bad("invalid samples", f"{detail} at sample {first}: re-export the audio")
    if (peak := float(np.abs(audio).max())) > MAX_PEAK:
        detail = f"peak {peak:.3g}, float audio must lie within +-{MAX_PEAK:g} (nominally +-1)"
        raise bad("invalid samples", f"{detail}: rescale it to +-1 or re-export it")


def flac_audio_bytes(path: Path) -> int | None:
    """Bytes after a FLAC file's metadata blocks (0: header only), or None when `path` is not
    a readable FLAC file."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"fLaC":
                return None
            while True:
                block = f.read(4)  # 1 bit last-block flag, 7 bits type, 24 bits length
                if len(block) < 4:
                    return 0
                f.seek(int.from_bytes(block[1:], "big"), 1)
                if block[0] & 0x80:
                    return max(0, path.stat().st_size - f.tell())
    except OSError:
        return None


def resample(audio: np.ndarray, rate: int) -> np.ndarray:
    """(N,) float32 at `rate` -> 16 kHz (torchaudio's windowed-sinc resampler)."""
    import torch
    import torchaudio.functional as AF

    with torch.no_grad():
        return AF.resample(torch.from_numpy(np.ascontiguousarray(audio)), rate, SAMPLE_RATE).numpy()


def _short(error: Exception) -> str:
    return str(error).strip().splitlines()[-1][:200]
