"""Where the feature cache keeps what, and what names it: settings and keys, paths (the
layout under `<cache_root>/features/`: docs/cache.md, "Layout")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechattn.data.features import FeatureConfig
from speechattn.utils import digest

# 3: content-addressed shards shared by every corpus folder, per-folder manifests
CACHE_VERSION = 3
_SHARD_KEY_RE = re.compile(r"^[0-9a-f]{32}$")  # `shard_key`: 32 hex digits
_MANIFEST_KEY_RE = re.compile(r"^[0-9a-f]{16}$")  # `manifest_key`: 16 hex digits
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


def shard_of(name: str) -> str | None:
    """The shard key of a settings folder's file (`<key>.npy`, `.stats.npy`, `.json`, `.claim`,
    their temporary names); None for the others (`settings.json`, a claims clock file)."""
    key = name.split(".", 1)[0]
    return key if _SHARD_KEY_RE.match(key) else None


def manifest_of(name: str) -> str | None:
    """The manifest key of a splits folder's file (`<key>.json`, `<key>.npz`, their temporary
    names); None for the others (plans, a claims clock file)."""
    key, _, rest = name.partition(".")
    return key if _MANIFEST_KEY_RE.match(key) and rest in ("json", "npz") else None


def plan_path(manifest: Path, host: str, pid: int) -> Path:
    """The plan of one process's extraction for a manifest (`gc` keeps its shards)."""
    return manifest.with_name(f"{manifest.stem}.{file_host(host)}-{pid}.plan.json")


def file_host(host: str) -> str:
    """A host name as it appears in a file name, whatever $SPEECHATTN_HOST holds."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host)


def reader_path(manifest: Path, host: str, pid: int) -> Path:
    """The mark of one process reading a manifest's shards (`gc` keeps them)."""
    return manifest.with_name(f"{manifest.stem}.{file_host(host)}-{pid}.reader")


def owner(path: Path) -> tuple[str, int] | None:
    """(host as in file names, pid) of the process a plan or reader file belongs to, or None
    for a name `plan_path` / `reader_path` did not make."""
    found = re.fullmatch(r"[^.]+\.(.+)-(\d+)\.(?:plan\.json|reader)", path.name)
    return (found.group(1), int(found.group(2))) if found else None
