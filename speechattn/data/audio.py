"""Decode one audio file with every check of docs/data.md, "Bad input": `load_audio` returns
float32 mono at 16 kHz (resampling and channel averaging noted in `AudioResult.notes`) or
raises `DataError` naming the file."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    """Decode `path` (or the `segment` of it) into float32 mono at 16 kHz.

    Args:
        path: audio file (FLAC, WAV, OGG, MP3, ... anything the installed libsndfile reads).
        sample_rate_policy: "resample" (convert, noted) or "error" for non-16 kHz audio.
        min_samples: fewer samples than this (after resampling) is a "too short" error.
        utt_id: utterance id to name in errors.
        segment: read only this part of the file (and this channel); None: all of it.
    """
    import soundfile as sf

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(path, "missing audio file", str(e), utt_id) from None
    if size == 0:
        raise DataError(path, "empty audio", "the file has 0 bytes", utt_id)
    try:
        info = sf.info(str(path))
    except (RuntimeError, OSError) as e:  # LibsndfileError is a RuntimeError
        raise DataError(path, "unreadable audio", _short(e), utt_id) from None
    start, frames = 0, -1
    if segment is not None:
        start, frames = _segment_samples(segment, info, path, utt_id)
    try:
        audio, rate = sf.read(
            str(path), frames=frames, start=start, dtype="float32", always_2d=True
        )  # (N, C)
    except (RuntimeError, OSError) as e:
        if flac_audio_bytes(path) == 0:
            # libsndfile reports an unknown length as 2**63 - 1 samples; say what is there
            raise DataError(
                path, "empty audio", "a FLAC header with no audio frames after it", utt_id
            ) from None
        detail = f"header says {info.frames} samples; {_short(e)}"
        raise DataError(path, "truncated or corrupt audio", detail, utt_id) from None
    expected = info.frames - start if frames < 0 else frames
    if info.frames > 0 and audio.shape[0] < expected:
        detail = f"header says {expected} samples from sample {start}, decoded {audio.shape[0]}"
        raise DataError(path, "truncated or corrupt audio", detail, utt_id)
    if audio.shape[0] == 0:
        raise DataError(path, "empty audio", "0 samples", utt_id)
    _check_values(audio, path, utt_id)
    if segment is not None and segment.channel is not None:
        audio = audio[:, segment.channel : segment.channel + 1]
    notes = []
    if audio.shape[1] > 1:
        notes.append(f"averaged {audio.shape[1]} channels")
    audio = audio.mean(axis=1) if audio.shape[1] > 1 else audio[:, 0]
    if rate != SAMPLE_RATE:
        if sample_rate_policy == "error":
            raise DataError(
                path, "wrong sample rate",
                f"{rate} Hz, expected {SAMPLE_RATE} Hz (data.sample_rate_policy=resample converts it)", utt_id,
            )  # fmt: skip
        audio = resample(audio, rate)
        notes.append(f"resampled from {rate} Hz")
    if audio.shape[0] < min_samples:
        raise DataError(
            path, "too short",
            f"{audio.shape[0]} samples ({audio.shape[0] / SAMPLE_RATE:.3f} s), need at least {min_samples}", utt_id,
        )  # fmt: skip
    return AudioResult(np.ascontiguousarray(audio, dtype=np.float32), notes)


def _segment_samples(segment: Segment, info, path: Path, utt_id: str | None) -> tuple[int, int]:
    """(first sample, sample count) of `segment` in the file `info` describes; a segment that
    ends past the file (beyond `SEGMENT_SLACK_S`) or names a channel it lacks is bad input."""
    rate = info.samplerate
    start, frames = round(segment.start * rate), round(segment.duration * rate)
    if segment.channel is not None and not 0 <= segment.channel < info.channels:
        raise DataError(
            path, "no such channel",
            f"the segment reads channel {segment.channel}; the file has {info.channels}", utt_id,
        )  # fmt: skip
    missing = start + frames - info.frames
    if segment.start < 0 or missing > SEGMENT_SLACK_S * rate:
        raise DataError(
            path, "segment outside the audio",
            f"{segment.start:g} s + {segment.duration:g} s, the file holds "
            f"{info.frames / rate:g} s: the manifest does not match this file", utt_id,
        )  # fmt: skip
    return start, min(frames, info.frames - start)


def _check_values(audio: np.ndarray, path: Path, utt_id: str | None) -> None:
    """Refuse NaN, infinite or absurdly large samples in `audio` (N, C) as decoded: one makes
    the file's features, and the corpus statistics, NaN or inf."""
    finite = np.isfinite(audio)
    if not finite.all():
        bad = audio[~finite]
        n_nan = int(np.isnan(bad).sum())
        raise DataError(
            path, "invalid samples",
            f"{n_nan} NaN and {bad.size - n_nan} infinite sample(s), the first at sample "
            f"{int(np.argmin(finite.all(axis=1)))}: re-export the audio", utt_id,
        )  # fmt: skip
    peak = float(np.abs(audio).max())
    if peak > MAX_PEAK:
        raise DataError(
            path, "invalid samples",
            f"peak {peak:.3g}, float audio must lie within +-{MAX_PEAK:g} (nominally +-1): "
            f"rescale it to +-1 or re-export it", utt_id,
        )  # fmt: skip


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
