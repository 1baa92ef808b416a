"""Where the feature cache keeps what, and what names it: settings and keys, paths, the shard
claim hook (multi-node extraction) and the clean-up of temporary files left by killed writers.

    <cache_root>/features/
        shards/<settings key>/settings.json       the extraction settings, for `ls`
        shards/<settings key>/<shard key>.npy        (frames, F) float16/32 features
        shards/<settings key>/<shard key>.stats.npy  (utterances, 2, F) float64 sums, sums of squares
        shards/<settings key>/<shard key>.json       commit marker: ids, lengths, failures, records
        splits/<manifest key>.npz                 per-utterance index of one corpus folder
        splits/<manifest key>.json                its commit marker: folder, listing digest, shard
                                                  keys' records, failures, notes
        splits/<manifest key>.plan.json           written while extracting: the shards it needs
        <16 hex digits>/                          a version-2 entry (old layout; `gc` removes it)
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechattn.data.features import FeatureConfig
from speechattn.utils import TEMP_MARK, digest

# 3: content-addressed shards shared by every corpus folder, per-folder manifests
CACHE_VERSION = 3
_TMP_RE = re.compile(re.escape(TEMP_MARK) + r"(\d+)-")
OLD_ENTRY_RE = re.compile(r"^[0-9a-f]{16}$")  # a version-2 entry: features/<key>/


@dataclass(frozen=True)
class ExtractionSettings:
    """Everything that changes what gets cached."""

    features: FeatureConfig = FeatureConfig()
    sample_rate_policy: str = "resample"
    min_frames: int = 1
    dtype: str = "float16"

    def fingerprint(self) -> dict[str, Any]:
        return {
            "cache_version": CACHE_VERSION,
            **self.features.fingerprint(),
            "sample_rate_policy": self.sample_rate_policy,
            "min_frames": self.min_frames,
            "dtype": self.dtype,
        }

    @property
    def key(self) -> str:
        """16 hex digits naming the folder of every shard extracted with these settings."""
        return digest(self.fingerprint())


def features_root(cache_root: str | Path) -> Path:
    return Path(cache_root).expanduser() / "features"


def shard_dir(cache_root: str | Path, settings: ExtractionSettings) -> Path:
    return features_root(cache_root) / "shards" / settings.key


def splits_dir(cache_root: str | Path) -> Path:
    return features_root(cache_root) / "splits"


def manifest_key(folder: str | Path, settings: ExtractionSettings) -> str:
    """A corpus folder's manifest name: its absolute path and the settings (16 hex digits)."""
    return digest({"folder": str(folder), "settings": settings.key})


def shard_key(settings: ExtractionSettings, members: list[tuple[str, int, str]]) -> str:
    """A shard's name: the settings and its utterances' (id, size, sha256) -- 32 hex digits.
    The same audio under the same ids gives the same shard wherever the corpus lives."""
    lines = (f"{utt_id}\t{size}\t{sha}\n" for utt_id, size, sha in members)
    return digest(settings.fingerprint(), lines, length=32)


@dataclass(frozen=True)
class ShardPaths:
    """The three files of one shard (features, statistics, commit marker)."""

    directory: Path
    key: str

    @property
    def npy(self) -> Path:
        return self.directory / f"{self.key}.npy"

    @property
    def stats(self) -> Path:
        return self.directory / f"{self.key}.stats.npy"

    @property
    def marker(self) -> Path:
        return self.directory / f"{self.key}.json"

    def data(self, kind: str) -> Path:
        """`kind` "npy" (features) or "stats"."""
        return self.npy if kind == "npy" else self.stats


DATA_KINDS = ("npy", "stats")  # a shard's two data files, as named in the records


# ----------------------------------------------------------------------------- concurrency hooks
# Multi-node extraction (issue #24 item 7) plugs in here: `claim_shard` is entered around the
# extraction and commit of one shard, `claim_is_live` is what `gc` asks before removing a shard,
# and `remove_stale_tmp` is the one place where temporary files of dead writers are deleted.


def claim_path(directory: Path, key: str) -> Path:
    """Where a claim on shard `key` would live (written by the claims module, read by gc)."""
    return directory / f"{key}.claim"


@contextmanager
def claim_shard(directory: Path, key: str) -> Iterator[bool]:
    """Held while this process extracts and commits shard `key`; yields whether the shard is
    ours to extract (False: another process holds it -- wait for its commit marker instead).

    Single-host for now: every shard is ours (two processes extracting the same shard write
    identical files through atomic renames, so the result is right, only the work is doubled).
    """
    yield True


def wait_for_shard(paths: ShardPaths) -> dict[str, Any]:
    """The commit marker of a shard another process claimed, once it is written (waiting with
    progress logging and a timeout belongs here). Unreachable while `claim_shard` always
    yields True."""
    raise NotImplementedError(f"shard {paths.key} is claimed by another process")


def claim_is_live(directory: Path, key: str, grace_s: float) -> bool:
    """Whether someone may be working on shard `key` (its claim file changed within `grace_s`)."""
    try:
        return time.time() - claim_path(directory, key).stat().st_mtime < grace_s
    except FileNotFoundError:
        return False


def remove_stale_tmp(directory: Path) -> None:
    """Delete temporary files (`<name>.tmp-<pid>-...`) whose writer no longer runs on this host.

    A file whose pid is alive here (or cannot be checked) is kept: it may be in progress.
    """
    for path in directory.glob(f"*{TEMP_MARK}*"):
        m = _TMP_RE.search(path.name)
        pid = int(m.group(1)) if m else -1
        try:
            if pid > 0 and pid != os.getpid():
                os.kill(pid, 0)
                continue  # still running: someone else's file
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path.unlink(missing_ok=True)
