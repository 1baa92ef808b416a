"""What in the feature cache is still used, and removing what is not (`ls` / `gc`): never a
file younger than the grace period, a shard with a live claim, one an extraction in progress
plans for, or one a running job reads. Rules: docs/cache.md, "Listing and cleaning".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speechattn.data.cache.shards import OLD_ENTRY_RE, features_root, file_host, owner
from speechattn.data.cache.store import load_manifest
from speechattn.data.claims import CLAIM_SUFFIX, ClaimConfig, Claims, host_name, pid_alive
from speechattn.data.errors import DataError
from speechattn.utils import TEMP_MARK

log = logging.getLogger(__name__)

GRACE_S = 6 * 3600.0  # younger files may belong to an extraction in progress: never removed
FOREIGN_READER_S = 24 * 3600.0  # a reader mark of another host counts as live this long
STALE_WARN_BYTES = 1 << 30  # log a hint when unused cache exceeds 1 GiB ...
STALE_WARN_SHARE = 0.10  # ... or 10 % of the feature cache
_WARNED: set[str] = set()  # cache roots already looked at by this process


@dataclass
class ShardFiles:
    """A shard's files on disk (features, statistics, marker, temporaries, claim)."""

    directory: Path
    key: str
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    newest: float = 0.0  # mtime of its youngest file


@dataclass
class ManifestInfo:
    path: Path
    folder: str
    exists: bool
    utterances: int
    shards: list[str]  # keys, in order
    in_use: set[str]  # the keys still worth keeping
    last_used: float
    status: str  # live | changed | missing | stale | unreadable


@dataclass
class Survey:
    """Everything under `<cache_root>/features`, sorted into used and unused."""

    root: Path
    manifests: list[ManifestInfo]
    shards: dict[tuple[str, str], ShardFiles]  # (settings key, shard key) -> files
    plans: list[Path]  # of extractions in progress
    dead_marks: list[Path]  # plans and reader marks of processes that are gone
    old_entries: list[tuple[Path, int, float]]  # (folder, bytes, newest mtime)
    protected: set[str]  # shard keys in use by a live/changed manifest, a plan or a reader

    def shard_bytes(self, keys: set[str]) -> int:
        return sum(s.bytes for (_, k), s in self.shards.items() if k in keys)

    @property
    def unreferenced(self) -> list[ShardFiles]:
        return [s for (_, k), s in self.shards.items() if k not in self.protected]

    @property
    def stale_bytes(self) -> int:
        """Bytes that `gc` could free (ignoring the grace period)."""
        return sum(s.bytes for s in self.unreferenced) + sum(b for _, b, _ in self.old_entries)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards.values()) + sum(b for _, b, _ in self.old_entries)


def _shard_files(features: Path) -> dict[tuple[str, str], ShardFiles]:
    shards: dict[tuple[str, str], ShardFiles] = {}
    for settings_dir in sorted(p for p in (features / "shards").glob("*") if p.is_dir()):
        with os.scandir(settings_dir) as entries:
            for entry in entries:
                if entry.name == "settings.json" or not entry.is_file():
                    continue
                st, key = entry.stat(), entry.name.split(".", 1)[0]
                item = shards.setdefault((settings_dir.name, key), ShardFiles(settings_dir, key))
                item.files.append(Path(entry.path))
                item.bytes += st.st_size
                item.newest = max(item.newest, st.st_mtime)
    return shards


def _old_entries(features: Path) -> list[tuple[Path, int, float]]:
    out = []
    for entry in sorted(features.glob("*")):
        if entry.is_dir() and OLD_ENTRY_RE.match(entry.name):
            stats = [p.stat() for p in entry.rglob("*") if p.is_file()]
            newest = max((s.st_mtime for s in stats), default=0)
            out.append((entry, sum(s.st_size for s in stats), newest))
    return out


def _files_in_use(meta: dict, z, folder: Path) -> set[str]:
    """Shard keys of a manifest whose audio files all still have the recorded size and mtime."""
    keys = meta["shards"]
    broken = np.zeros(len(keys), dtype=bool)
    files = zip(
        z["files_rel"].tolist(),
        z["files_size"].tolist(),
        z["files_mtime"].tolist(),
        z["files_shard"].tolist(),
    )
    for rel, size, mtime, k in files:
        try:
            st = os.stat(folder / rel.decode())
            broken[k] |= st.st_size != size or st.st_mtime_ns != mtime
        except FileNotFoundError:
            broken[k] = True
    return {key for key, bad in zip(keys, broken) if not bad}


def _manifest_info(path: Path, check_files: bool, forget_missing: bool) -> ManifestInfo:
    try:
        meta, z = load_manifest(path)
    except DataError:
        return ManifestInfo(path, "?", False, 0, [], set(), path.stat().st_mtime, "unreadable")
    folder, keys = Path(meta["folder"]), meta["shards"]
    exists = folder.is_dir()
    with z:
        if not exists:  # a folder that may come back keeps its shards unless forgotten
            in_use: set[str] = set() if forget_missing else set(keys)
            status = "stale" if forget_missing else "missing"
        else:
            in_use = _files_in_use(meta, z, folder) if check_files else set(keys)
            status = "live" if in_use == set(keys) else "changed" if in_use else "stale"
    return ManifestInfo(
        path, meta["folder"], exists, meta["utterances"], keys, in_use, path.stat().st_mtime, status
    )


def owner_running(path: Path, younger_than: float) -> bool:
    """Whether the process a plan or reader file names may still run: alive (a file of this
    host), else the file is younger than `younger_than` seconds."""
    found = owner(path)
    if found is not None and found[0] == file_host(host_name()):
        return pid_alive(found[1])
    return time.time() - path.stat().st_mtime < younger_than


def survey(
    cache_root: str | Path,
    grace_s: float = GRACE_S,
    check_files: bool = True,
    forget_missing: bool = False,
    claim_config: ClaimConfig | None = None,
) -> Survey:
    """Sort the cache into used and unused. `check_files=False` (the start-up hint) only asks
    whether each manifest's folder exists, without a stat per audio file; `forget_missing`
    counts a manifest whose folder is not there as stale, not missing."""
    features = features_root(cache_root)
    splits = features / "splits"
    manifests = [
        _manifest_info(path, check_files, forget_missing)
        for path in sorted(splits.glob("*.json"))
        if not path.name.endswith(".plan.json")
    ]
    protected = set().union(*(m.in_use for m in manifests))
    shards_of = {m.path.stem: m.shards for m in manifests}
    plans, dead_marks = [], []
    plan_live_s = max(grace_s, (claim_config or ClaimConfig()).expiry_s)  # touched every shard
    # a running job reading a manifest keeps all of its shards, changed or missing corpus alike
    reader_live_s = max(grace_s, FOREIGN_READER_S)
    for mark in sorted([*splits.glob("*.plan.json"), *splits.glob("*.reader")]):
        plan = mark.name.endswith(".plan.json")
        try:
            if not owner_running(mark, plan_live_s if plan else reader_live_s):
                dead_marks.append(mark)
            elif plan:
                protected.update(json.loads(mark.read_text())["shards"])
                plans.append(mark)
            else:
                protected.update(shards_of.get(mark.name.split(".", 1)[0], []))
        except (OSError, ValueError, KeyError):
            continue
    return Survey(
        features,
        manifests,
        _shard_files(features),
        plans,
        dead_marks,
        _old_entries(features),
        protected,
    )


def _claimed(shard: ShardFiles, claim_config: ClaimConfig | None) -> bool:
    """Whether a live process holds the shard's claim (someone is extracting it)."""
    if shard.directory / f"{shard.key}{CLAIM_SUFFIX}" not in shard.files:
        return False
    with closing(Claims(shard.directory, claim_config)) as claims:  # no heartbeat: claims nothing
        return claims.live_holder(shard.key) is not None


def _older(path: Path, grace_s: float, now: float) -> bool:
    try:
        return now - path.stat().st_mtime >= grace_s
    except FileNotFoundError:
        return False


def collect(
    cache_root: str | Path,
    dry_run: bool = False,
    grace_s: float = GRACE_S,
    claim_config: ClaimConfig | None = None,
    forget_missing: bool = False,
) -> dict:
    """Remove what no manifest uses. Returns what was (or, with `dry_run`, would be) removed:
    {"manifests", "shards", "old_entries", "temp_files", "bytes", "kept" (unused shards or
    entries too young or claimed to remove)}."""
    s = survey(cache_root, grace_s, forget_missing=forget_missing, claim_config=claim_config)
    now = time.time()
    removed = {
        "manifests": [],
        "shards": [],
        "old_entries": [],
        "temp_files": [],
        "bytes": 0,
        "kept": 0,
    }

    def remove(*paths: Path) -> None:
        if not dry_run:
            for path in paths:
                path.unlink(missing_ok=True)

    for m in s.manifests:
        if m.status in ("stale", "unreadable") and now - m.last_used >= grace_s:
            removed["manifests"].append(m.path)
            remove(m.path, m.path.with_suffix(".npz"))  # the json (commit marker) first
    remove(*s.dead_marks)
    for shard in s.shards.values():  # debris of killed writers, even beside a used shard
        old = [f for f in shard.files if TEMP_MARK in f.name and _older(f, grace_s, now)]
        if old and shard.key in s.protected and not _claimed(shard, claim_config):
            removed["temp_files"] += old
            remove(*old)
    for shard in s.unreferenced:
        if now - shard.newest < grace_s or _claimed(shard, claim_config):
            removed["kept"] += 1
            continue
        removed["shards"].append(shard.key)
        removed["bytes"] += shard.bytes
        # uncommitted first: never a marker without data
        remove(shard.directory / f"{shard.key}.json", *shard.files)
    for folder, size, newest in s.old_entries:
        if now - newest < grace_s:
            removed["kept"] += 1
            continue
        removed["old_entries"].append(folder)
        removed["bytes"] += size
        if not dry_run:
            shutil.rmtree(folder, ignore_errors=True)
    return removed


def warn_if_stale(cache_root: str | Path) -> None:
    """Once per process and cache: one log line when unused cache exceeds STALE_WARN_BYTES or
    STALE_WARN_SHARE of it (folders checked for existence only: cheap at start-up)."""
    root = str(Path(cache_root).expanduser())
    if root in _WARNED:
        return
    _WARNED.add(root)
    try:  # counted as if gone folders were forgotten: a deleted corpus's cache is news
        s = survey(root, check_files=False, forget_missing=True)
    except OSError:
        return
    stale, total = s.stale_bytes, s.total_bytes
    if stale and (stale >= STALE_WARN_BYTES or stale >= STALE_WARN_SHARE * total):
        missing = any(not m.exists for m in s.manifests)
        log.warning(
            "%.1f GB of feature cache (%.0f %% of %s) is not used by any corpus: "
            "python -m speechattn.data.cache gc --cache-dir %s%s",
            stale / 1e9,
            100 * stale / max(total, 1),
            s.root,
            root,
            " --forget-missing (corpus folders that are gone: see ls)" if missing else "",
        )
