"""`Utterance`: what every corpus reader yields and the feature cache keys, extracts and
fingerprints (one audio file, or a `Segment` of one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Segment:
    """The part of an audio file an utterance is: `duration` seconds from `start`, one channel
    or (None) every channel averaged. Sample counts round as lhotse's `compute_num_samples`."""

    start: float
    duration: float
    channel: int | None = None

    @property
    def key(self) -> str:
        return f"{self.start!r}+{self.duration!r}/{self.channel}"


@dataclass(frozen=True)
class Utterance:
    """One utterance of a corpus (LibriSpeech layout, a folder of audio, lhotse manifests)."""

    utt_id: str  # LibriSpeech: "<speaker>-<chapter>-<utt:04d>"
    speaker: str  # "" where the corpus does not say
    chapter: str
    path: Path  # absolute path of the audio file
    transcript: str
    split: str  # the split folder, e.g. "train-clean-100" or "synth-clean"
    num_samples: int | None = None  # filled by `with_info=True` (header read)
    sample_rate: int | None = None
    # while size, mtime and ctime are as recorded, the file's sha256 stands (the ctime moves on
    # every write and mtime change, and cannot be set back)
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    segment: Segment | None = None  # the part of the file read (lhotse cuts); None: all of it

    def content_key(self, sha: str) -> str:
        """This utterance's audio in a shard's key: the file's sha256 (and segment)."""
        return sha if self.segment is None else f"{sha}@{self.segment.key}"

    @property
    def duration(self) -> float | None:
        if self.num_samples is None or not self.sample_rate:
            return None
        return self.num_samples / self.sample_rate
