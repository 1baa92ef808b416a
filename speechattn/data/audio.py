"""Decode one audio file with every check of docs/data.md, "Bad input".

`load_audio` returns float32 mono samples at 16 kHz or raises `DataError` naming the file:
unreadable (not audio / bad header), truncated or corrupt (header fine, data not), empty, too
short, wrong sample rate (under `sample_rate_policy="error"`). Non-16 kHz audio is otherwise
resampled and multi-channel audio averaged; both are reported in `AudioResult.notes` so the
caller can warn about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speechattn.data.errors import DataError

SAMPLE_RATE = 16000


@dataclass
class AudioResult:
    audio: np.ndarray  # float32 (N,) at SAMPLE_RATE
    source_rate: int
    notes: list[str] = field(default_factory=list)  # e.g. "resampled from 8000 Hz"


def load_audio(
    path: str | Path,
    sample_rate_policy: str = "resample",
    min_samples: int = 1,
    utt_id: str | None = None,
) -> AudioResult:
    """Decode `path` into float32 mono at 16 kHz.

    Args:
        path: audio file (FLAC, WAV, ... anything libsndfile reads).
        sample_rate_policy: "resample" (convert, noted) or "error" for non-16 kHz audio.
        min_samples: fewer samples than this (after resampling) is a "too short" error.
        utt_id: utterance id to name in errors.
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
    try:
        audio, rate = sf.read(str(path), dtype="float32", always_2d=True)  # (N, C)
    except (RuntimeError, OSError) as e:
        if flac_audio_bytes(path) == 0:
            # libsndfile reports an unknown length as 2**63 - 1 samples; say what is there
            raise DataError(
                path, "empty audio", "a FLAC header with no audio frames after it", utt_id
            ) from None
        raise DataError(
            path,
            "truncated or corrupt audio",
            f"header says {info.frames} samples; {_short(e)}",
            utt_id,
        ) from None
    if info.frames > 0 and audio.shape[0] < info.frames:
        raise DataError(
            path,
            "truncated or corrupt audio",
            f"header says {info.frames} samples, decoded {audio.shape[0]}",
            utt_id,
        )
    if audio.shape[0] == 0:
        raise DataError(path, "empty audio", "0 samples", utt_id)
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
    return AudioResult(np.ascontiguousarray(audio, dtype=np.float32), int(rate), notes)


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
