"""Corpus readers (`data.corpus`, docs/data.md): `librispeech` and `embedded` (LibriSpeech
layout, `speechattn.data.librispeech`), `folder` (every audio file under ROOT/<split>, the id
its path under ROOT without suffix, the speaker a folder level of it) and `lhotse`
(`speechattn.data.lhotse_corpus`). Phone labels and split lists come from CPC files, as for
LibriSpeech, except for lhotse.

A reader's split is a `Source` for the feature cache: `listing()` is cheap and gives a digest
that changes whenever the audio might have; `scan(issues)` lists the utterances.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from speechattn.data.errors import DataError, Issues
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
from speechattn.data.utterances import Utterance
from speechattn.errors import ConfigError

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


# ----------------------------------------------------------------------------- sources


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
                issues.report(
                    DataError(path, "duplicate utterance",
                              f"{out[utt_id].path.name} is utterance {utt_id} too: keep one of the two", utt_id),
                    "scan",
                )  # fmt: skip
            elif (speaker := self._speaker(path, utt_id, issues)) is not None:
                out[utt_id] = Utterance(utt_id, speaker, "", path, "", self.split,
                                        size=size, mtime_ns=mtime, ctime_ns=ctime)  # fmt: skip
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


# ----------------------------------------------------------------------------- readers


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
    """Any folder of audio (see the module docstring)."""

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
