"""Corpus readers (`data.corpus`; formats: docs/data.md): `librispeech` and `embedded`
(LibriSpeech layout, `speechattn.data.librispeech`), `folder` (every audio file under
ROOT/<split>) and `lhotse` (manifests, with their own speakers and phone alignments; the
others read CPC label and split files).

A reader's split is a `Source` for the feature cache: `listing()` is cheap and gives a digest
that changes whenever the audio might have; `scan(issues)` lists the utterances.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from speechattn.data.errors import DataError, Issues
from speechattn.data.features import HOP_LENGTH, SAMPLE_RATE
from speechattn.data.librispeech import (
    BROKEN_LINK,
    LabelFiles,
    SplitListing,
    broken_link,
    file_stamp,
    read_alignments,
    scan_split,
    speaker_of,
    stamp_digest,
    walk_split,
)
from speechattn.data.utterances import Segment, Utterance
from speechattn.errors import ConfigError
from speechattn.utils import IGNORE_INDEX

# What the folder corpus reads; a file libsndfile cannot decode (an MP3 with a libsndfile
# older than 1.1) is reported, naming it, when its features are extracted.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3")


@dataclass(frozen=True)
class Listing:
    """What a source's cache manifest is for: `folder` (the audio lies under it), `name` (names
    the manifest) and `digest` (32 hex digits; another digest: the audio may have changed)."""

    folder: Path
    name: str
    digest: str


class Source(Protocol):
    """One split of a corpus, as the feature cache reads it."""

    split: str  # for progress lines
    empty_detail: str  # why a scan that found nothing usable found nothing

    def listing(self) -> Listing: ...

    def scan(self, issues: Issues) -> list[Utterance]: ...


@dataclass
class SplitSource:
    """A LibriSpeech-layout split folder, ROOT/<split>."""

    root: Path
    split: str
    _walk: SplitListing | None = field(default=None, init=False)
    empty_detail = "the split folder holds no valid audio"

    def listing(self) -> Listing:
        self._walk = walk_split(self.root, self.split)
        return Listing(self._walk.folder, str(self._walk.folder), self._walk.digest)

    def scan(self, issues: Issues) -> list[Utterance]:
        return scan_split(self.root, self.split, issues, listing=self._walk)


class FolderSource:
    """Every audio file under ROOT/<split>, at any depth (links followed, loops skipped)."""

    def __init__(self, root: Path, split: str, speaker_level: int | None) -> None:
        self.root, self.split, self.speaker_level = root, split, speaker_level
        self.folder = (root / split).resolve()
        self.empty_detail = f"no audio files ({', '.join(AUDIO_SUFFIXES)}) under it"
        self._files: list[tuple[str, int, int, int]] = []

    def listing(self) -> Listing:
        if not self.folder.is_dir():
            where = f"data.root={self.root}, split {self.split!r}"
            raise DataError(self.folder, "corpus folder not found", where)
        self._files = walk_audio(self.folder)
        digest = stamp_digest(
            f"{rel}\t{size}\t{mtime}\t{ctime}\n" for rel, size, mtime, ctime in self._files
        )
        # "folder:": a LibriSpeech reading of the same folder has other ids, so another manifest
        return Listing(self.folder, f"folder:{self.folder}", digest)

    def scan(self, issues: Issues) -> list[Utterance]:
        prefix = os.path.relpath(self.folder, self.root.resolve())
        prefix = "" if prefix == "." else prefix.replace(os.sep, "/") + "/"
        out: dict[str, Utterance] = {}
        for rel, size, mtime, ctime in self._files:
            path = self.folder / rel
            utt_id = prefix + rel.rsplit(".", 1)[0]
            if size == BROKEN_LINK:
                issues.report(broken_link(path, utt_id), "scan")
            elif utt_id in out:
                detail = f"{out[utt_id].path.name} is utterance {utt_id} too: keep one of the two"
                issues.report(DataError(path, "duplicate utterance", detail, utt_id), "scan")
            elif (speaker := self._speaker(path, utt_id, issues)) is not None:
                out[utt_id] = Utterance(
                    utt_id,
                    speaker,
                    "",
                    path,
                    "",
                    self.split,
                    size=size,
                    mtime_ns=mtime,
                    ctime_ns=ctime,
                )
        return sorted(out.values(), key=lambda u: u.utt_id)

    def _speaker(self, path: Path, utt_id: str, issues: Issues) -> str | None:
        if self.speaker_level is None:
            return ""
        try:
            return folder_speaker(utt_id, self.speaker_level)
        except ValueError as e:
            issues.report(DataError(path, "no speaker folder", str(e), utt_id), "scan")
            return None


def walk_audio(folder: Path) -> list[tuple[str, int, int, int]]:
    """(path relative to `folder` with "/", size, mtime_ns, ctime_ns) of every audio file under
    it, sorted; a link that cannot be followed has size `BROKEN_LINK`; each linked folder is
    walked once."""
    found, seen = [], set()

    def walk(path: str, rel: str) -> None:
        real = os.path.realpath(path)
        if real in seen:
            return
        seen.add(real)
        with os.scandir(path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = rel + entry.name
                try:
                    is_dir = entry.is_dir()
                except OSError:  # a link loop (ELOOP): `file_stamp` calls it broken
                    is_dir = False
                if is_dir:
                    walk(entry.path, name + "/")
                elif entry.name.lower().endswith(AUDIO_SUFFIXES):
                    if (stamp := file_stamp(entry)) is not None:
                        found.append((name, *stamp))

    walk(str(folder), "")
    return sorted(found)


def folder_speaker(utt_id: str, level: int) -> str:
    """The speaker of a folder corpus's utterance: the folder at `level` of its path (0: the
    first folder under the root, -1: the one holding the file). ValueError when there is none."""
    folders = utt_id.split("/")[:-1]
    if not -len(folders) <= level < len(folders):
        raise ValueError(
            f"data.speaker_level={level}, but the file lies {len(folders)} folder(s) deep "
            f"({'/'.join(folders) or 'directly in the root'})"
        )
    return folders[level]


@dataclass
class Corpus:
    """A LibriSpeech-layout corpus (the built-in one too): its splits, speakers (from the ids)
    and phone labels (CPC files, `LabelFiles`)."""

    root: Path
    label_files: LabelFiles
    num_phones: int | None

    def source(self, split: str) -> Source:
        return SplitSource(self.root, split)

    def speaker_of(self, utt_id: str) -> str:
        return speaker_of(utt_id)

    def missing_labels(self) -> Path | None:
        """The phone-label file the probes would read, when it does not exist (None: it does,
        or `data.alignments` is null)."""
        path = self.label_files.path(self.label_files.alignments)
        return path if path is not None and not path.is_file() else None

    def phone_labels(
        self, ids: list[str], issues: Issues
    ) -> tuple[dict[str, np.ndarray], list[str], Path]:
        """Phone labels of `ids` ({utt_id: (T_lab,) int16 class ids at 10 ms}; problems reported,
        those left out), the phone set (class id -> symbol), and the file errors name."""
        path = self.label_files.path(self.label_files.alignments)
        assert path is not None
        phone_set = self.label_files.load_phone_set(self.num_phones)
        labels = read_alignments(path, phone_set, issues, wanted=set(ids))
        if phone_set is None:
            top = max((int(v.max()) for v in labels.values()), default=-1)
            phone_set = [str(i) for i in range(top + 1)]
        return labels, phone_set, path


@dataclass
class FolderCorpus(Corpus):
    """Any folder of audio (docs/data.md, "Your own audio folder")."""

    speaker_level: int | None

    def source(self, split: str) -> Source:
        return FolderSource(self.root, split, self.speaker_level)

    def speaker_of(self, utt_id: str) -> str:
        if self.speaker_level is None:
            raise ConfigError(
                "data.speaker_level is null, so this folder corpus has no speakers; set it to "
                "the folder level that names the speaker (0: the first folder under data.root, "
                "-1: the folder holding each file)"
            )
        return folder_speaker(utt_id, self.speaker_level)


HOP_S = HOP_LENGTH / SAMPLE_RATE  # one label frame, 10 ms


@dataclass(frozen=True)
class _Entry:
    """What the probes need of one utterance, beside its audio."""

    manifest: Path
    speakers: frozenset[str]
    phones: tuple[tuple[str, float, float], ...] | None  # (symbol, start, end), recording time
    start: float  # the utterance's segment in its recording, seconds
    duration: float


def manifests_of(root: Path, split: str) -> list[Path]:
    """The manifest files of `split` in `root`: [CutSet file named `split`], [*_cuts_<split>.json*]
    or [*_recordings_<split>.json*, *_supervisions_<split>.json*]; DataError naming the folder
    and what it holds when none fit."""
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
        root,
        "lhotse manifests not found",
        f"split {split!r}: expected a CutSet file of that name, *_cuts_{split}.jsonl.gz, or "
        f"*_recordings_{split}.jsonl.gz with *_supervisions_{split}.jsonl.gz; found "
        f"{held or 'no manifest'}",
    )


class LhotseSource:
    """One split's manifests; parsed once, by `listing` (which must see every audio file)."""

    empty_detail = "no usable utterances in the manifests"

    def __init__(self, corpus: LhotseCorpus, split: str) -> None:
        self.corpus, self.split = corpus, split
        self.manifests = manifests_of(corpus.root, split)
        self._utterances: list[Utterance] = []
        self._problems: list[DataError] = []  # reported by `scan`

    def listing(self) -> Listing:
        """Parse the manifests and stat every audio file; the digest covers the manifests' and
        audio files' stats, each utterance's segment, and the problems found."""
        self._utterances, self._problems = self._parse()
        digest = stamp_digest(
            [
                *(
                    f"{m}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_ctime_ns}\n"
                    for m in self.manifests
                    for st in [m.stat()]
                ),
                *(
                    f"{u.utt_id}\t{u.path}\t{u.segment.key if u.segment else 'whole'}\t{u.size}\t"
                    f"{u.mtime_ns}\t{u.ctime_ns}\n"
                    for u in self._utterances
                ),
                *(f"{e}\n" for e in self._problems),
            ]
        )
        paths = [str(u.path.parent) for u in self._utterances]
        folder = Path(os.path.commonpath(paths)) if paths else self.manifests[0].parent
        name = "lhotse:" + "|".join(str(m) for m in self.manifests)
        return Listing(folder, name, digest)

    def scan(self, issues: Issues) -> list[Utterance]:
        for error in self._problems:
            issues.report(error, "scan")
        return self._utterances

    def _parse(self) -> tuple[list[Utterance], list[DataError]]:
        try:
            import lhotse
        except ImportError:
            msg = "data.corpus=lhotse needs lhotse: pip install 'speechattn[lhotse]'"
            raise ConfigError(msg) from None
        manifest = self.manifests[0]
        try:
            loaded = [lhotse.load_manifest(m) for m in self.manifests]
        except Exception as e:  # lhotse raises plain exceptions for a malformed file
            detail = f"{type(e).__name__}: {e}"
            raise DataError(manifest, "unreadable lhotse manifest", detail) from None
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

            def unpack(cut: Any) -> tuple:  # (id, recording, start, duration, channel, sups)
                if type(cut).__name__ != "MonoCut":
                    raise DataError(
                        manifest,
                        "unsupported cut",
                        f"a {type(cut).__name__}; only "
                        "MonoCut (one recording, one channel or all) is read",
                        cut.id,
                    )
                if getattr(cut, "recording", None) is None:
                    raise DataError(manifest, "cut without a recording", "it has no audio", cut.id)
                return cut.id, cut.recording, cut.start, cut.duration, cut.channel, cut.supervisions
        else:
            raise DataError(
                manifest,
                "not a CutSet",
                f"it holds a {type(loaded[0]).__name__}; "
                "give a CutSet, or the split name of a recordings + supervisions pair",
            )
        utterances, problems, stats, seen = [], [], {}, set()
        for row in rows:
            try:
                utt_id, recording, start, duration, channel, sups = unpack(row)
                if utt_id in seen:  # the first one is read, as in an audio folder
                    detail = f"id {utt_id} appears twice"
                    raise DataError(where, "duplicate utterance", detail, utt_id)
                seen.add(utt_id)
                path, segment = _audio_segment(recording, start, duration, channel, where, utt_id)
                if path not in stats:
                    try:
                        stats[path] = os.stat(path)
                    except OSError as e:
                        detail = f"{e.strerror}; named by {where}"
                        raise DataError(path, "missing audio file", detail, utt_id) from None
            except DataError as e:
                problems.append(e)
                continue
            st = stats[path]
            speakers = frozenset(s.speaker for s in sups if s.speaker)
            kind = self.corpus.label_files.alignments  # the alignment kind, e.g. "phone"
            phones = [p for s in sups for p in ((s.alignment or {}).get(kind) or [])]
            self.corpus.entries[utt_id] = _Entry(
                where,
                speakers,
                tuple((p.symbol, p.start, p.start + p.duration) for p in phones) or None,
                start,
                duration,
            )
            utterances.append(
                Utterance(
                    utt_id,
                    next(iter(speakers), ""),
                    "",
                    path,
                    "",
                    self.split,
                    size=st.st_size,
                    mtime_ns=st.st_mtime_ns,
                    ctime_ns=st.st_ctime_ns,
                    segment=segment,
                )
            )
        return sorted(utterances, key=lambda u: u.utt_id), problems


def _audio_segment(
    recording: Any, start: float, duration: float, channel: Any, where: Path, utt_id: str
) -> tuple[Path, Segment | None]:
    """The audio file and the part of it an utterance reads (None: the whole file)."""
    if recording.transforms:
        raise DataError(
            where,
            "unsupported recording",
            f"recording {recording.id} has transforms "
            "(speed or volume perturbation, resampling): they are not applied here",
            utt_id,
        )
    wanted = (
        None
        if channel is None or isinstance(channel, list) and len(channel) != 1
        else (channel[0] if isinstance(channel, list) else int(channel))
    )
    sources = [s for s in recording.sources if wanted is None or wanted in s.channels]
    if len(sources) != 1 or sources[0].type != "file":
        kinds = sorted({s.type for s in recording.sources})
        raise DataError(
            where,
            "unsupported recording",
            f"recording {recording.id}: one audio file per utterance is read, it has "
            f"{len(recording.sources)} source(s) of type {kinds}",
            utt_id,
        )
    source = sources[0]
    path = Path(source.source).expanduser().absolute()
    in_file = None if wanted is None or len(source.channels) == 1 else source.channels.index(wanted)
    whole = start == 0 and round(duration * recording.sampling_rate) == recording.num_samples
    if whole and in_file is None:
        return path, None
    return path, Segment(float(start), float(duration), in_file)


@dataclass
class LhotseCorpus(Corpus):
    """lhotse manifests (docs/data.md, "lhotse manifests"): one utterance per cut, or per
    supervision of a recordings + supervisions pair."""

    label_tolerance: int
    # what the probes need of each utterance, filled as its split's manifests are read
    entries: dict[str, _Entry] = field(default_factory=dict, repr=False)

    def source(self, split: str) -> LhotseSource:
        return LhotseSource(self, split)

    def missing_labels(self) -> None:
        return None  # the labels are in the manifests, checked utterance by utterance

    def speaker_of(self, utt_id: str) -> str:
        entry = self.entries[utt_id]
        if len(entry.speakers) != 1:
            raise DataError(
                entry.manifest,
                "no single speaker",
                f"its supervisions name {sorted(entry.speakers) or 'no speaker'}: the probes need "
                f"one speaker per utterance (cut the recording at its supervisions)",
                utt_id,
            )
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
            try:
                labels[u] = self._frames(u, self.entries[u], index)
            except DataError as e:
                issues.report(e, "labels")
        where = next(iter(self.entries.values())).manifest if self.entries else self.root
        return labels, phone_set, where

    def _frames(self, utt_id: str, entry: _Entry, index: dict[str, int]) -> np.ndarray:
        """(T_lab,) int16 phone ids of one utterance: frame i of a segment starting at s takes
        the item covering s + (i + 0.5) * 10 ms (recording time), -100 where none does."""
        if not entry.phones:
            kind = self.label_files.alignments
            detail = f"no alignment[{kind!r}] in its supervisions"
            raise DataError(entry.manifest, "missing alignment", detail, utt_id)
        items = sorted(entry.phones, key=lambda p: p[1])
        if unknown := [p[0] for p in items if p[0] not in index]:
            detail = f"{unknown[0]!r} is not in the phone set ({len(index)} symbols)"
            raise DataError(entry.manifest, "unknown phone symbol", detail, utt_id)
        begin, end = entry.start, entry.start + entry.duration
        last = min(max(p[2] for p in items), end)
        n = round((last - begin) / HOP_S)
        lead = round((items[0][1] - begin) / HOP_S)
        if n <= 0 or lead > self.label_tolerance:
            raise DataError(
                entry.manifest,
                "alignment does not cover the audio",
                f"its phones span {items[0][1]:.3f}-{items[-1][2]:.3f} s, the audio "
                f"{begin:.3f}-{end:.3f} s (recording time)",
                utt_id,
            )
        centers = begin + (np.arange(n) + 0.5) * HOP_S
        starts = np.array([p[1] for p in items])
        ends = np.array([p[2] for p in items])
        which = np.searchsorted(starts, centers, side="right") - 1
        covered = (which >= 0) & (centers < ends[np.maximum(which, 0)])
        symbols = np.array([index[p[0]] for p in items])
        return np.where(covered, symbols[np.maximum(which, 0)], IGNORE_INDEX).astype(np.int16)
