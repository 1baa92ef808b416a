"""Read a LibriSpeech-layout corpus (real LibriSpeech or the built-in one) and its CPC labels
(the layout and formats: docs/data.md, "Formats")."""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speechattn.data.errors import DataError, Issues
from speechattn.data.utterances import Utterance

AUDIO_SUFFIX = ".flac"
BROKEN_LINK = -1  # size, mtime and ctime `walk_split` lists for a link it cannot follow
UTT_RE = re.compile(r"^(\d+)-(\d+)-(\d+)$")


def speaker_of(utt_id: str) -> str:
    """The speaker of a LibriSpeech id "<speaker>-<chapter>-<utt>" (`UTT_RE`)."""
    return utt_id.split("-", 1)[0]


def find_splits(root: str | Path) -> list[str]:
    """Names of the split folders under `root` (folders holding <speaker>/<chapter>/*.flac);
    `DataError` naming the root when it does not exist or holds no such folder."""
    root = Path(root).expanduser()
    if not root.is_dir():
        detail = "expected a LibriSpeech folder: ROOT/<split>/<speaker>/<chapter>/*.flac"
        raise DataError(root, "corpus root not found", detail)
    splits = [p.name for p in sorted(root.iterdir()) if p.is_dir() and _looks_like_split(p)]
    if not splits:
        found = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())[:12]
        raise DataError(
            root,
            "not a LibriSpeech layout",
            f"expected split folders such as train-clean-100/ holding <speaker>/<chapter>/*{AUDIO_SUFFIX}; "
            f"found {found or 'nothing'}",
        )
    return splits


def _looks_like_split(folder: Path) -> bool:
    """Whether the first <speaker> folder holds a <chapter> folder with audio."""
    speaker = next((p for p in sorted(folder.iterdir()) if p.is_dir()), None)
    chapters = sorted(speaker.iterdir()) if speaker else []
    return any(c.is_dir() and any(c.glob(f"*{AUDIO_SUFFIX}")) for c in chapters)


def _first_word(line: str) -> tuple[str, str]:
    """`"id rest"` split at the first run of any whitespace (spaces or tabs) -> (id, rest)."""
    parts = line.split(maxsplit=1)
    return (parts[0], parts[1] if len(parts) > 1 else "") if parts else ("", "")


def _duplicate(path: Path, kind: str, n: int, first: int, utt_id: str) -> DataError:
    detail = f"line {n} repeats {utt_id} (first on line {first}); which one is right is unknown"
    return DataError(path, f"duplicate {kind}", detail, utt_id)


def read_transcripts(path: Path, issues: Issues) -> dict[str, str | None]:
    """`{utt_id: text}` from one `*.trans.txt`; malformed lines are reported, and so is an id on
    two lines (its value is then None)."""
    out: dict[str, str | None] = {}
    first_line: dict[str, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        issues.report(DataError(path, "unreadable transcript file", str(e)), "scan")
        return out
    for n, line in enumerate(lines, 1):
        utt_id, text = _first_word(line)
        if not utt_id:
            continue
        if not UTT_RE.match(utt_id):
            error = DataError(path, "malformed transcript line", f"line {n}: {line[:60]!r}")
            issues.report(error, "scan")
        elif utt_id not in first_line:
            first_line[utt_id], out[utt_id] = n, text.strip()
        elif out[utt_id] is not None:  # report each utterance once
            out[utt_id] = None
            error = _duplicate(path, "transcript line", n, first_line[utt_id], utt_id)
            issues.report(error, "scan")
    return out


@dataclass(frozen=True)
class SplitListing:
    """What `walk_split` saw of one split folder: (speaker, chapter, ((file name, size,
    mtime_ns, ctime_ns), ...)) per <speaker>/<chapter>/ folder, sorted, and a digest of it."""

    folder: Path  # absolute
    chapters: tuple[tuple[str, str, tuple[tuple[str, int, int, int], ...]], ...]
    digest: str  # 32 hex digits over the relative paths, sizes, mtimes and ctimes


def walk_split(root: str | Path, split: str) -> SplitListing:
    """One `os.scandir` walk of `root/split` with a stat per file (`DataError`: no folder)."""
    root = Path(root).expanduser().resolve()
    folder = root / split
    if not folder.is_dir():
        raise DataError(folder, "split folder not found", f"available splits: {find_splits(root)}")
    chapters = []
    for speaker in _subfolders(str(folder)):
        for chapter in _subfolders(os.path.join(folder, speaker)):
            with os.scandir(os.path.join(folder, speaker, chapter)) as entries:
                stamps = [(entry.name, file_stamp(entry)) for entry in entries]
            files = sorted((name, *stamp) for name, stamp in stamps if stamp is not None)
            chapters.append((speaker, chapter, tuple(files)))
    digest = stamp_digest(
        f"{speaker}/{chapter}/{name}\t{size}\t{mtime}\t{ctime}\n"
        for speaker, chapter, files in chapters
        for name, size, mtime, ctime in files
    )
    return SplitListing(folder, tuple(chapters), digest)


def stamp_digest(lines: Iterable[str]) -> str:
    """32 hex digits of sha256 over `lines`: a listing's digest (each line a file's stamp)."""
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:32]


def file_stamp(entry: os.DirEntry) -> tuple[int, int, int] | None:
    """(size, mtime_ns, ctime_ns) of a directory entry that is a file (through links),
    `BROKEN_LINK` three times for a link that cannot be followed, None for anything else."""
    try:
        is_file = entry.is_file()
        broken = not is_file and entry.is_symlink() and not entry.is_dir()
    except OSError:  # a link loop (ELOOP)
        is_file, broken = False, True
    if is_file:
        st = entry.stat()
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns
    return (BROKEN_LINK, BROKEN_LINK, BROKEN_LINK) if broken else None


def _subfolders(path: str) -> list[str]:
    with os.scandir(path) as entries:
        return sorted(e.name for e in entries if e.is_dir())


def scan_split(
    root: str | Path,
    split: str,
    issues: Issues | None = None,
    with_info: bool = False,
    listing: SplitListing | None = None,
) -> list[Utterance]:
    """All utterances of `root/split`, sorted by id; audio without a transcript line,
    transcript lines without audio and badly named files are reported to `issues`.
    `with_info=True` reads each header for `num_samples`/`sample_rate`."""
    issues = issues or Issues()
    listing = listing or walk_split(root, split)
    utts: list[Utterance] = []
    for speaker, chapter, files in listing.chapters:
        chapter_dir = listing.folder / speaker / chapter
        trans_name = f"{speaker}-{chapter}.trans.txt"
        trans_path = chapter_dir / trans_name
        audio: dict[str, tuple[int, int, int]] = {}  # utterance id -> (size, mtime_ns, ctime_ns)
        other: dict[str, str] = {}  # utterance id -> name of a file with another extension
        has_transcripts = False
        reported: set[str | None] = set()  # ids of broken audio links
        for name, size, mtime, ctime in files:
            if size == BROKEN_LINK:
                error = broken_link(chapter_dir / name)
                issues.report(error, "scan")
                reported.add(error.utt_id)
            elif name.endswith(AUDIO_SUFFIX):
                audio[name[: -len(AUDIO_SUFFIX)]] = (size, mtime, ctime)
            elif name == trans_name:
                has_transcripts = True
            elif UTT_RE.match(stem := name.partition(".")[0]):
                other[stem] = name
        transcripts = read_transcripts(trans_path, issues) if has_transcripts else {}
        for utt_id in sorted(audio):
            path = chapter_dir / f"{utt_id}{AUDIO_SUFFIX}"
            m = UTT_RE.match(utt_id)
            if not m or m.group(1) != speaker or m.group(2) != chapter:
                detail = f"expected {speaker}-{chapter}-NNNN{AUDIO_SUFFIX}"
                issues.report(DataError(path, "unexpected file name", detail), "scan")
                continue
            if transcripts.get(utt_id, "") is None:
                continue  # a duplicated transcript line, reported already
            if utt_id not in transcripts:
                missing = f"{trans_name} is missing"
                where = f"no line for it in {trans_name}" if has_transcripts else missing
                issues.report(DataError(path, "missing transcript", where, utt_id), "scan")
                continue
            size, mtime, ctime = audio[utt_id]
            num_samples, rate = _header(path) if with_info else (None, None)
            utts.append(
                Utterance(
                    utt_id,
                    speaker,
                    chapter,
                    path,
                    transcripts[utt_id],
                    split,
                    num_samples,
                    rate,
                    size,
                    mtime,
                    ctime,
                )
            )
        for utt_id in sorted(set(transcripts) - set(audio) - reported):
            detail = f"no {utt_id}{AUDIO_SUFFIX}"
            if utt_id in other:  # e.g. a .wav: say what was found and why it is not used
                read = f"only {AUDIO_SUFFIX} files are read (convert it to {AUDIO_SUFFIX})"
                detail += f"; found {other[utt_id]}, but {read}"
            issues.report(DataError(trans_path, "transcript without audio", detail, utt_id), "scan")
    return utts


def broken_link(link: Path, utt_id: str | None = None) -> DataError:
    """The error for a symbolic link that cannot be followed (named with `utt_id`, or the
    LibriSpeech id of its file name)."""
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    try:
        os.stat(link)
        why = "cannot be followed"  # it was broken during the walk; followed now
    except OSError as e:  # "No such file or directory", "Too many levels of symbolic links"
        why = e.strerror or str(e)
    stem = link.name[: -len(AUDIO_SUFFIX)] if link.name.endswith(AUDIO_SUFFIX) else None
    utt_id = utt_id or (stem if stem and UTT_RE.match(stem) else None)
    detail = f"it points to {target} ({why}): restore the target or remove the link"
    return DataError(link, "broken symlink", detail, utt_id)


def _header(path: Path) -> tuple[int | None, int | None]:
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except RuntimeError:
        return None, None  # reported with the full reason when the audio is decoded
    return int(info.frames), int(info.samplerate)


def read_split_list(path: str | Path) -> list[str]:
    """Utterance ids, one per line (CPC `train_split.txt` / `test_split.txt`), order kept."""
    path = Path(path)
    if not path.is_file():
        detail = "set data.alignments_dir or data.train_list/test_list"
        raise DataError(path, "split list not found", detail)
    return list(dict.fromkeys(ln.strip() for ln in path.read_text().splitlines() if ln.strip()))


def read_phone_set(path: str | Path) -> list[str]:
    """Phone symbols, one per line; the line number (from 0) is the class id."""
    path = Path(path)
    symbols = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if len(set(symbols)) != len(symbols):
        raise DataError(path, "duplicate phone symbols", "each line must hold a distinct symbol")
    return symbols


def read_alignments(
    path: str | Path,
    phone_set: list[str] | None,
    issues: Issues | None = None,
    wanted: set[str] | None = None,
) -> dict[str, np.ndarray]:
    """`{utt_id: (T,) int16 phone ids}` of the `wanted` ids (None: all) in a CPC-format file.
    Tokens are class ids or symbols of `phone_set` (None: any non-negative class id); a line
    with a token outside it is reported and gets no labels."""
    issues = issues or Issues()
    path = Path(path)
    if not path.is_file():
        detail = "set data.alignments_dir, or data.alignments=null"
        raise DataError(path, "alignment file not found", detail)
    symbol_id = {s: i for i, s in enumerate(phone_set or [])}
    n_classes = len(phone_set) if phone_set is not None else np.iinfo(np.int16).max
    out: dict[str, np.ndarray] = {}
    first_line: dict[str, int] = {}
    duplicated: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            utt_id, rest = _first_word(line)  # any whitespace: CPC files use spaces, some tabs
            if not utt_id or (wanted is not None and utt_id not in wanted):
                continue
            if utt_id in first_line:  # two label sequences: neither can be trusted
                if utt_id not in duplicated:
                    duplicated.add(utt_id)
                    out.pop(utt_id, None)
                    error = _duplicate(path, "alignment", n, first_line[utt_id], utt_id)
                    issues.report(error, "labels")
                continue
            first_line[utt_id] = n
            try:
                out[utt_id] = _label_ids(rest, symbol_id, n_classes, path, n, utt_id)
            except DataError as e:
                issues.report(e, "labels")
    return out


def _label_ids(
    text: str, symbol_id: dict[str, int], n_classes: int, path: Path, n: int, utt_id: str
) -> np.ndarray:
    """(T,) int16 class ids of line `n`'s labels `text` (class ids, or symbols of `symbol_id`);
    `DataError` when one is not a class or there are none."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy warns (not raises) on a non-integer token
        try:  # the C parser: ~5x faster than split + int
            ids = np.fromstring(text, dtype=np.int64, sep=" ")
        except (DeprecationWarning, ValueError):
            ids = None
    if ids is None:  # symbols rather than class ids (or junk)
        tokens = text.split()
        if bad := [t for t in tokens if t not in symbol_id and not t.lstrip("-").isdigit()]:
            detail = f"line {n}: {bad[0]!r} is not in the phone set ({len(symbol_id)} symbols)"
            raise DataError(path, "unknown phone symbol", detail, utt_id)
        ids = np.array([symbol_id[t] if t in symbol_id else int(t) for t in tokens], np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_classes):
        bad_id = int(ids[(ids < 0) | (ids >= n_classes)][0])
        detail = f"line {n}: class {bad_id} outside 0..{n_classes - 1}"
        raise DataError(path, "unknown phone symbol", detail, utt_id)
    if ids.size == 0:
        raise DataError(path, "empty alignment", f"line {n} has no labels", utt_id)
    return ids.astype(np.int16)


@dataclass
class LabelFiles:
    """Where a corpus's label and split files are (names in `folder`; None: not read)."""

    folder: Path
    alignments: str | None = "converted_aligned_phones.txt"
    phone_set: str | None = "phone_set.txt"
    train_list: str | None = "train_split.txt"
    test_list: str | None = "test_split.txt"

    def path(self, name: str | None) -> Path | None:
        return None if name is None else self.folder / name

    def load_phone_set(self, num_phones: int | None) -> list[str] | None:
        """Symbols from `phone_set.txt`, or "0".."num_phones-1", or None when unknown."""
        path = self.path(self.phone_set)
        if path is not None and path.is_file():
            symbols = read_phone_set(path)
            if num_phones is not None and num_phones != len(symbols):
                detail = f"{len(symbols)} symbols, data.num_phones={num_phones}"
                raise DataError(path, "phone set size mismatch", detail)
            return symbols
        return None if num_phones is None else [str(i) for i in range(num_phones)]
