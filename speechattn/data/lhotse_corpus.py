"""lhotse manifests as a corpus (`data.corpus=lhotse`; the optional extra `[lhotse]`; docs/data.md,
"lhotse manifests").

A split is a CutSet file in `data.root` (named by its file name), or `*_cuts_<split>.jsonl*`,
or the pair `*_recordings_<split>.jsonl*` + `*_supervisions_<split>.jsonl*`: one utterance per
cut (its segment of the recording), or per supervision. For the probes, the speaker is the
supervisions' `speaker`; frame i of an utterance starting at s gets the `alignment["phone"]`
item covering s + (i + 0.5) * 10 ms (recording time); frames no item covers are -100.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.data.audio import SAMPLE_RATE
from speechattn.data.corpora import Corpus, Listing
from speechattn.data.errors import DataError, Issues
from speechattn.data.features import HOP_LENGTH
from speechattn.data.librispeech import stamp_digest
from speechattn.data.utterances import Segment, Utterance
from speechattn.errors import ConfigError
from speechattn.utils import IGNORE_INDEX

HOP_S = HOP_LENGTH / SAMPLE_RATE  # one label frame, 10 ms


@dataclass(frozen=True)
class _Entry:
    """What the probes need of one utterance, beside its audio."""

    manifest: Path
    speakers: frozenset[str]
    phones: tuple[tuple[str, float, float], ...] | None  # (symbol, start, end), recording time
    start: float  # the utterance's segment in its recording, seconds
    duration: float


def _lhotse() -> Any:
    try:
        import lhotse
    except ImportError:
        raise ConfigError(
            "data.corpus=lhotse needs lhotse: pip install 'speechattn[lhotse]'"
        ) from None
    return lhotse


def manifests_of(root: Path, split: str) -> list[Path]:
    """The manifest files of `split` in `root` (see the module docstring): [cuts] or
    [recordings, supervisions]. DataError naming the folder and what it holds when none fit."""
    if (root / split).is_file():
        return [root / split]

    def one(kind: str) -> Path | None:
        found = sorted(p for p in root.glob(f"*{kind}_{split}.json*") if p.is_file())
        if len(found) > 1:
            detail = f"{[p.name for p in found]} all name split {split!r}"
            raise DataError(root, "ambiguous lhotse manifests", detail)
        return found[0] if found else None

    if cuts := one("cuts"):
        return [cuts]
    recordings, supervisions = one("recordings"), one("supervisions")
    if recordings and supervisions:
        return [recordings, supervisions]
    held = sorted(p.name for p in root.glob("*.json*"))[:12] if root.is_dir() else []
    raise DataError(
        root, "lhotse manifests not found",
        f"split {split!r}: expected a CutSet file of that name, *_cuts_{split}.jsonl.gz, or "
        f"*_recordings_{split}.jsonl.gz with *_supervisions_{split}.jsonl.gz; found "
        f"{held or 'no manifest'}",
    )  # fmt: skip


class LhotseSource:
    """One split's manifests; parsed once, by `listing` (which must see every audio file)."""

    empty_detail = "no usable utterances in the manifests"

    def __init__(self, corpus: LhotseCorpus, split: str) -> None:
        self.corpus, self.split = corpus, split
        self.manifests = manifests_of(corpus.root, split)
        self._utterances: list[Utterance] = []
        self._problems: list[DataError] = []

    def listing(self) -> Listing:
        """Parse the manifests and stat every audio file; the digest covers the manifests' and
        audio files' stats, each utterance's segment, and the problems found."""
        self._utterances, self._problems = self._parse()
        digest = stamp_digest([
            *(f"{m}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_ctime_ns}\n"
              for m in self.manifests for st in [m.stat()]),
            *(f"{u.utt_id}\t{u.path}\t{u.segment.key if u.segment else 'whole'}\t{u.size}\t"
              f"{u.mtime_ns}\t{u.ctime_ns}\n" for u in self._utterances),
            *(f"{e}\n" for e in self._problems),
        ])  # fmt: skip
        paths = [str(u.path.parent) for u in self._utterances]
        folder = Path(os.path.commonpath(paths)) if paths else self.manifests[0].parent
        name = "lhotse:" + "|".join(str(m) for m in self.manifests)
        return Listing(folder, name, digest)

    def scan(self, issues: Issues) -> list[Utterance]:
        for error in self._problems:
            issues.report(error, "scan")
        return self._utterances

    def _parse(self) -> tuple[list[Utterance], list[DataError]]:
        lhotse = _lhotse()
        manifest = self.manifests[0]
        try:
            loaded = [lhotse.load_manifest(m) for m in self.manifests]
        except Exception as e:  # lhotse raises plain exceptions for a malformed file
            raise DataError(
                manifest, "unreadable lhotse manifest", f"{type(e).__name__}: {e}"
            ) from None
        if len(loaded) == 2:
            recordings, supervisions = loaded
            rows, where = list(supervisions), self.manifests[1]

            def unpack(s: Any) -> tuple:
                if s.recording_id not in recordings:
                    detail = f"recording {s.recording_id!r} is not in {manifest.name}"
                    raise DataError(where, "missing recording", detail, s.id)
                return s.id, recordings[s.recording_id], s.start, s.duration, s.channel, [s]
        elif isinstance(loaded[0], lhotse.CutSet):
            rows, where = list(loaded[0]), manifest

            def unpack(cut: Any) -> tuple:
                return _cut_item(cut, manifest)
        else:
            raise DataError(manifest, "not a CutSet", f"it holds a {type(loaded[0]).__name__}; "
                            "give a CutSet, or the split name of a recordings + supervisions pair")  # fmt: skip
        utterances, problems, stats, seen = [], [], {}, set()
        for row in rows:
            try:
                utt_id, recording, start, duration, channel, sups = unpack(row)
                if utt_id in seen:  # the first one is read, as in an audio folder
                    raise DataError(
                        where, "duplicate utterance", f"id {utt_id} appears twice", utt_id
                    )
                seen.add(utt_id)
                path, segment = _audio_segment(recording, start, duration, channel, where, utt_id)
                if path not in stats:
                    try:
                        stats[path] = os.stat(path)
                    except OSError as e:
                        raise DataError(
                            path, "missing audio file", f"{e.strerror}; named by {where}", utt_id
                        ) from None
            except DataError as e:
                problems.append(e)
                continue
            st = stats[path]
            speakers = frozenset(s.speaker for s in sups if s.speaker)
            kind = self.corpus.label_files.alignments  # the alignment kind, e.g. "phone"
            phones = [p for s in sups for p in ((s.alignment or {}).get(kind) or [])]
            self.corpus.entries[utt_id] = _Entry(
                where, speakers, tuple((p.symbol, p.start, p.start + p.duration) for p in phones) or None,
                start, duration,
            )  # fmt: skip
            utterances.append(Utterance(utt_id, next(iter(speakers), ""), "", path, "", self.split,
                                        size=st.st_size, mtime_ns=st.st_mtime_ns,
                                        ctime_ns=st.st_ctime_ns, segment=segment))  # fmt: skip
        return sorted(utterances, key=lambda u: u.utt_id), problems


def _cut_item(cut: Any, manifest: Path) -> tuple:
    """(id, recording, start, duration, channel, supervisions) of a cut."""
    if type(cut).__name__ != "MonoCut":
        raise DataError(manifest, "unsupported cut", f"a {type(cut).__name__}; only MonoCut "
                        "(one recording, one channel or all) is read", cut.id)  # fmt: skip
    if getattr(cut, "recording", None) is None:
        raise DataError(manifest, "cut without a recording", "it has no audio", cut.id)
    return cut.id, cut.recording, cut.start, cut.duration, cut.channel, cut.supervisions


def _audio_segment(recording: Any, start: float, duration: float, channel: Any, where: Path,
                   utt_id: str) -> tuple[Path, Segment | None]:  # fmt: skip
    """The audio file and the part of it an utterance reads (None: the whole file)."""
    if recording.transforms:
        raise DataError(where, "unsupported recording", f"recording {recording.id} has transforms "
                        "(speed or volume perturbation, resampling): they are not applied here", utt_id)  # fmt: skip
    wanted = None if channel is None or isinstance(channel, list) and len(channel) != 1 else (
        channel[0] if isinstance(channel, list) else int(channel))  # fmt: skip
    sources = [s for s in recording.sources if wanted is None or wanted in s.channels]
    if len(sources) != 1 or sources[0].type != "file":
        kinds = sorted({s.type for s in recording.sources})
        raise DataError(where, "unsupported recording",
                        f"recording {recording.id}: one audio file per utterance is read, it has "
                        f"{len(recording.sources)} source(s) of type {kinds}", utt_id)  # fmt: skip
    source = sources[0]
    path = Path(source.source).expanduser().absolute()
    in_file = None if wanted is None or len(source.channels) == 1 else source.channels.index(wanted)
    whole = start == 0 and round(duration * recording.sampling_rate) == recording.num_samples
    if whole and in_file is None:
        return path, None
    return path, Segment(float(start), float(duration), in_file)


@dataclass
class LhotseCorpus(Corpus):
    """lhotse manifests (see the module docstring)."""

    label_tolerance: int
    entries: dict[str, _Entry] = field(default_factory=dict)  # filled as splits are read

    def source(self, split: str) -> LhotseSource:
        return LhotseSource(self, split)

    def missing_labels(self) -> None:
        return None  # the labels are in the manifests, checked utterance by utterance

    def speaker_of(self, utt_id: str) -> str:
        entry = self.entries[utt_id]
        if len(entry.speakers) != 1:
            raise DataError(
                entry.manifest, "no single speaker",
                f"its supervisions name {sorted(entry.speakers) or 'no speaker'}: the probes need "
                f"one speaker per utterance (cut the recording at its supervisions)", utt_id,
            )  # fmt: skip
        return next(iter(entry.speakers))

    def phone_labels(
        self, ids: list[str], issues: Issues
    ) -> tuple[dict[str, np.ndarray], list[str], Path]:
        phone_set = self.label_files.load_phone_set(self.num_phones)
        if phone_set is None:
            phone_set = sorted({p[0] for e in self.entries.values() for p in e.phones or ()})
        index = {s: i for i, s in enumerate(phone_set)}
        labels = {}
        for u in ids:
            entry = self.entries[u]
            try:
                labels[u] = self._frames(u, entry, index)
            except DataError as e:
                issues.report(e, "labels")
        where = next(iter(self.entries.values())).manifest if self.entries else self.root
        return labels, phone_set, where

    def _frames(self, utt_id: str, entry: _Entry, index: dict[str, int]) -> np.ndarray:
        """(T_lab,) int16 phone ids of one utterance (-100 where no item covers a frame)."""
        if not entry.phones:
            kind = self.label_files.alignments
            detail = f"no alignment[{kind!r}] in its supervisions"
            raise DataError(entry.manifest, "missing alignment", detail, utt_id)
        items = sorted(entry.phones, key=lambda p: p[1])
        unknown = [p[0] for p in items if p[0] not in index]
        if unknown:
            detail = f"{unknown[0]!r} is not in the phone set ({len(index)} symbols)"
            raise DataError(entry.manifest, "unknown phone symbol", detail, utt_id)
        begin, end = entry.start, entry.start + entry.duration
        last = min(max(p[2] for p in items), end)
        n = round((last - begin) / HOP_S)
        lead = round((items[0][1] - begin) / HOP_S)
        if n <= 0 or lead > self.label_tolerance:
            raise DataError(
                entry.manifest, "alignment does not cover the audio",
                f"its phones span {items[0][1]:.3f}-{items[-1][2]:.3f} s, the audio "
                f"{begin:.3f}-{end:.3f} s (recording time)", utt_id,
            )  # fmt: skip
        centers = begin + (np.arange(n) + 0.5) * HOP_S
        starts = np.array([p[1] for p in items])
        ends = np.array([p[2] for p in items])
        which = np.searchsorted(starts, centers, side="right") - 1
        covered = (which >= 0) & (centers < ends[np.maximum(which, 0)])
        symbols = np.array([index[p[0]] for p in items])
        return np.where(covered, symbols[np.maximum(which, 0)], IGNORE_INDEX).astype(np.int16)
