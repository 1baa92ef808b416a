"""Extraction: fingerprint the audio, plan content-defined shards, extract the missing ones in
parallel, shared with other processes through claims, and commit the folder's manifest
(`extract_features`); the start-up that skips it all when the source did not change
(`open_source`). Several processes: docs/multinode.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.data.cache.gc import warn_if_stale
from speechattn.data.cache.shards import (
    ExtractionSettings,
    ShardTask,
    extract_shard,
    file_sha256,
    intact,
    invalidate,
    manifest_key,
    manifest_of,
    map_in_processes,
    plan_path,
    plan_shards,
    process_pool,
    read_marker,
    save_npz,
    shard_dir,
    shard_key,
    shard_of,
    shard_paths,
    splits_dir,
)
from speechattn.data.cache.store import (
    DEFAULT_MAX_OPEN_SHARDS,
    OPEN_SHARDS,
    FeatureStore,
    load_manifest,
    manifest_meta,
    touch,
)
from speechattn.data.claims import (
    ClaimConfig,
    claim_map,
    claim_pending,
    host_name,
    remove_stale_temps,
)
from speechattn.data.corpora import Source, SplitSource
from speechattn.data.errors import DataError, Issues, Skip
from speechattn.data.utterances import Utterance
from speechattn.utils import atomic_write_text, progress_bar

log = logging.getLogger(__name__)

HASH_BATCH = 32  # files per fingerprinting task handed to a worker process


def _relative(path: Path, folder: Path) -> str:
    """`path` relative to `folder` (so the fingerprint memo survives a move)."""
    text, prefix = str(path), str(folder) + os.sep
    return text[len(prefix) :] if text.startswith(prefix) else os.path.relpath(text, folder)


def _hash_files(paths: list[str]) -> list[str]:
    return [file_sha256(p) for p in paths]


def fingerprints(
    utterances: Sequence[Utterance],
    folder: Path,
    manifests: Iterable[Path],
    workers: int,
    progress: bool,
) -> list[str]:
    """sha256 of each utterance's file, memoised in the manifests by (relative path, size,
    mtime_ns, ctime_ns): an unchanged corpus, or one renamed within its filesystem, reads
    nothing; a file written since has a new ctime and is hashed again. A file several
    utterances are segments of is hashed once."""
    stamps = [(_relative(u.path, folder), u.size, u.mtime_ns, u.ctime_ns) for u in utterances]
    missing = {stamp: str(u.path) for stamp, u in zip(stamps, utterances)}  # stamp -> its file
    found: dict[tuple[str, int, int, int], str] = {}
    for manifest in manifests:  # the memo: read until nothing is missing
        if not missing:
            break
        try:
            _, z = load_manifest(manifest)
            with z:
                rel = [r.decode() for r in z["files_rel"].tolist()]
                size, mtime, ctime = z["files_size"], z["files_mtime"], z["files_ctime"]
                memo = zip(rel, size.tolist(), mtime.tolist(), ctime.tolist())
                for stamp, h in zip(memo, z["files_sha"].tolist()):
                    if missing.pop(stamp, None) is not None:
                        found[stamp] = h.decode()
        except (DataError, KeyError, ValueError, OSError):
            continue  # an unreadable manifest (or one without ctimes) is only a lost memo
    if missing:
        log.info("fingerprinting %d audio files (sha256)", len(missing))
        paths = list(missing.values())
        batches = [paths[j : j + HASH_BATCH] for j in range(0, len(paths), HASH_BATCH)]
        hashes = []
        with progress_bar(len(paths), "fingerprinting audio", progress) as advance:
            with closing(map_in_processes(_hash_files, batches, workers)) as results:
                for batch in results:
                    hashes += batch
                    advance(len(batch))
        found.update(zip(missing, hashes))
    return [found[stamp] for stamp in stamps]


def _check_failures(marker: dict[str, Any], issues: Issues, path_of: dict[str, str]) -> None:
    """Under `on_error=error`, raise the first bad file a shard recorded (skips are reported
    from the manifest)."""
    if marker["failures"] and issues.on_error == "error":
        f = marker["failures"][0]
        raise DataError(path_of[f["utt_id"]], f["problem"], f["detail"], f["utt_id"])


def _touch_plan(plan: Path, folder: Path, settings: ExtractionSettings, keys: list[str]) -> None:
    """Mark the plan as alive; written again if something removed it (a `gc` run by hand)."""
    try:
        os.utime(plan)
    except FileNotFoundError:
        log.warning("%s was removed while its extraction ran: written again", plan)
        _write_plan(plan, folder, settings, keys)


def _write_plan(plan: Path, folder: Path, settings: ExtractionSettings, keys: list[str]) -> None:
    """The shards an extraction in progress needs: `gc` keeps them while the plan is fresh."""
    atomic_write_text(
        plan,
        json.dumps(
            {
                "folder": str(folder),
                "settings_key": settings.key,
                "shards": keys,
                "host": host_name(),
                "pid": os.getpid(),
                "started": time.time(),
            }
        ),
    )


def extract_features(
    utterances: Sequence[Utterance],
    settings: ExtractionSettings,
    cache_root: str | Path,
    issues: Issues | None = None,
    workers: int | None = None,
    shard_size: int = 64,
    progress: bool = True,
    description: str = "extracting features",
    on_shard_done: Callable[[int], None] | None = None,
    verify: bool = False,
    *,
    folder: str | Path | None = None,
    name: str | None = None,
    listing: str | None = None,
    scan_skips: Sequence[Skip] = (),
    max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
    claim_config: ClaimConfig | None = None,
) -> FeatureStore:
    """Cached features of `utterances`; extracts the shards not in the cache first.

    Bad audio goes to `issues`. `on_shard_done(i)`: this process committed the i-th shard of
    its plan. `verify`: hash every audio file and checksum every cache file first. `folder`
    (default: the split folder(s) the files are in) holds the audio, paths recorded relative
    to it; `name` (default: the folder) names the manifest; `listing` is the source's digest
    `open_source` compares at the next start; `scan_skips` are recorded to be reported again.
    """
    issues = issues or Issues()
    if not utterances:
        raise ValueError("extract_features needs at least one utterance")
    if folder is None:
        folder = Path(os.path.commonpath([str(u.path.parents[2]) for u in utterances]))
    folder = Path(folder)
    claim_config = claim_config or ClaimConfig()
    directory, manifests = shard_dir(cache_root, settings), splits_dir(cache_root)
    # stale temporary files: a shard's or manifest's once its claim is dead, a plan's once old
    for where, unit_of in ((directory, shard_of), (manifests, manifest_of)):
        where.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(where, unit_of, claim_config)
    settings_file = directory / "settings.json"
    if not settings_file.is_file():
        atomic_write_text(settings_file, json.dumps(settings.fingerprint(), indent=2))
    manifest = manifests / f"{manifest_key(name or folder, settings)}.json"
    n_workers = workers or min(os.cpu_count() or 1, 8)

    # 1. identity: content fingerprints (memoised), content-defined shards
    others = sorted(p for p in manifests.glob("*.json") if not p.name.endswith(".plan.json"))
    memo = [] if verify else [manifest, *(p for p in others if p != manifest)]
    shas = fingerprints(utterances, folder, memo, n_workers, progress)
    ranges = plan_shards([u.utt_id for u in utterances], shard_size)
    members = [(u.utt_id, u.size, u.content_key(h)) for u, h in zip(utterances, shas)]
    keys = [shard_key(settings, members[a:b]) for a, b in ranges]
    plan = plan_path(manifest, host_name(), os.getpid())
    _write_plan(plan, folder, settings, keys)

    # 2. what is there already (intact), what needs extracting
    path_of = {u.utt_id: str(u.path) for u in utterances}
    markers = {key: intact(shard_paths(directory, key), verify) for key in keys}
    for marker in markers.values():  # a shard done earlier may already hold a bad file: fail now
        if marker is not None:
            _check_failures(marker, issues, path_of)
    pending = {
        key: ShardTask(
            directory,
            key,
            [(u.utt_id, str(u.path), u.segment) for u in utterances[a:b]],
            settings,
            len(utterances),
        )
        for key, (a, b) in zip(keys, ranges)
        if markers[key] is None
    }
    left = sum(len(t.items) for t in pending.values())  # utterances
    if pending:
        log.info(
            "%s: %d of %d shards (%d utterances) to extract -> %s",
            description,
            len(pending),
            len(keys),
            left,
            directory,
        )

    # 3. extract: every pending shard claimed, written and committed here, or by another process
    start = time.perf_counter()
    with progress_bar(len(utterances), description, progress and bool(pending)) as advance:
        advance(len(utterances) - left)
        counted: set[str] = set()

        def committed(key: str) -> bool:
            """Whether shard `key` is done (by anyone); the bar counts each shard once."""
            done = read_marker(shard_paths(directory, key).marker) is not None
            if done and key not in counted:
                counted.add(key)
                advance(len(pending[key].items))
            return done

        while pending:  # one round, unless a shard another process wrote is already damaged
            workers = min(n_workers, len(pending))
            with process_pool(workers) as pool:  # forked before the claims' heartbeat thread starts
                shards = claim_map(
                    extract_shard,
                    dict(pending),
                    directory,
                    committed,
                    pool,
                    workers,
                    claim_config,
                    "shards",
                )
                with closing(shards):  # closed: claims released, then the pool ends
                    for key, marker in shards:
                        OPEN_SHARDS.forget(str(shard_paths(directory, key).npy))  # replaced file
                        markers[key] = marker
                        _check_failures(marker, issues, path_of)
                        _touch_plan(plan, folder, settings, keys)  # alive: gc keeps its shards
                        if on_shard_done is not None:
                            on_shard_done(keys.index(key))
            for key in list(pending):
                if markers[key] is None:  # committed by another process
                    paths = shard_paths(directory, key)
                    OPEN_SHARDS.forget(str(paths.npy))
                    markers[key] = intact(paths, verify=False)
                if markers[key] is not None:
                    _check_failures(markers[key], issues, path_of)
                    del pending[key]
    if left:
        log.info("%s: done in %.1f s", description, time.perf_counter() - start)

    # 4. the folder's manifest (npz, then its json: the commit), then the plan goes. One process
    # writes it, the others wait (a json and an npz of two writers would not match).
    records = json.loads(json.dumps({key: markers[key]["files"] for key in keys}))

    def written(unit: str) -> bool:
        """Whether the manifest committed is this one: shards, their files, the listing."""
        try:
            meta = manifest_meta(manifest)
        except DataError:
            return False
        return (meta["shards"], meta["records"], meta["listing"]) == (keys, records, listing)

    for _ in claim_pending([manifest.stem], manifests, written, claim_config, "manifests"):
        _write_manifest(
            manifest, folder, settings, utterances, shas, ranges, keys, markers, listing, scan_skips
        )
    touch(manifest)  # used now (`ls`), whoever wrote it
    plan.unlink(missing_ok=True)
    store = FeatureStore(manifest, max_open_shards)
    report(store, issues, scan=False)
    return store


def _write_manifest(
    manifest: Path,
    folder: Path,
    settings: ExtractionSettings,
    utterances: Sequence[Utterance],
    shas: list[str],
    ranges: list[tuple[int, int]],
    keys: list[str],
    markers: dict[str, dict[str, Any]],
    listing: str | None,
    scan_skips: Sequence[Skip],
) -> None:
    """The folder's manifest: per-utterance index arrays from the commit `markers` of its
    shards (`keys`), the audio files' fingerprints (`shas`)."""
    path_of = {u.utt_id: str(u.path) for u in utterances}
    shards = [markers[key] for key in keys]
    lengths = [np.asarray(m["lengths"], dtype=np.int64) for m in shards]  # per shard: (n,)
    arrays = {
        "utt_ids": np.array([u for m in shards for u in m["utt_ids"]], dtype=str),
        "shard": np.repeat(np.arange(len(shards), dtype=np.int32), [len(x) for x in lengths]),
        "row": np.concatenate([np.arange(len(x), dtype=np.int32) for x in lengths]),
        "offset": np.concatenate([np.cumsum(x) - x for x in lengths]),  # its first frame
        "length": np.concatenate(lengths),
        # every audio file (bad ones too): the fingerprint memo, and what `gc` checks
        "files_rel": np.array([_relative(u.path, folder).encode() for u in utterances]),
        "files_size": np.array([u.size for u in utterances], dtype=np.int64),
        "files_mtime": np.array([u.mtime_ns for u in utterances], dtype=np.int64),
        "files_ctime": np.array([u.ctime_ns for u in utterances], dtype=np.int64),
        "files_sha": np.array([h.encode() for h in shas]),
        "files_shard": np.repeat(
            np.arange(len(ranges), dtype=np.int32), [b - a for a, b in ranges]
        ),
    }
    meta = {
        "version": 3,
        "folder": str(folder),
        "settings_key": settings.key,
        "settings": settings.fingerprint(),
        "listing": listing,
        "utterances": len(arrays["utt_ids"]),
        "audio_files": len(utterances),
        "frames": int(arrays["length"].sum()),
        "audio_seconds": sum(m["seconds"] for m in shards),
        "feature_dim": settings.features.dim,
        "dtype": settings.dtype,
        "shards": keys,
        "records": {key: markers[key]["files"] for key in keys},
        "failures": [
            {**f, "path": path_of[f["utt_id"]], "stage": "audio"}
            for m in shards
            for f in m["failures"]
        ],
        "scan_skips": [vars(s) for s in scan_skips],
        "notes": [[u, f"{path_of[u]}: {note}"] for m in shards for u, note in m["notes"]],
        "npz": save_npz(manifest.with_suffix(".npz"), arrays),
        "created": time.time(),
    }
    atomic_write_text(manifest, json.dumps(meta))  # commit


def report(store: FeatureStore, issues: Issues, scan: bool) -> None:
    """Report what the cache recorded as bad input (the scan's problems too when `scan`) to
    `issues`, and log the audio conversions."""
    for s in (store.scan_skips if scan else []) + store.failures:
        issues.report(DataError(s.path, s.problem, s.detail, s.utt_id), s.stage)
    limit = 5
    for _, note in store.notes[:limit]:
        log.warning("audio converted: %s", note)
    if len(store.notes) > limit:
        log.warning(
            "audio converted: %d more files (listed in %s)",
            len(store.notes) - limit,
            store.manifest,
        )


def open_split(
    root: str | Path,
    split: str,
    settings: ExtractionSettings,
    cache_root: str | Path,
    issues: Issues | None = None,
    **options: Any,
) -> FeatureStore:
    """The cached features of the LibriSpeech-layout split folder `root/split` (`open_source`
    of its `SplitSource`; `options` as there)."""
    return open_source(SplitSource(Path(root), split), settings, cache_root, issues, **options)


def open_source(
    source: Source,
    settings: ExtractionSettings,
    cache_root: str | Path,
    issues: Issues | None = None,
    *,
    workers: int | None = None,
    shard_size: int = 64,
    progress: bool = True,
    verify: bool = False,
    max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
    on_shard_done: Callable[[int], None] | None = None,
    claim_config: ClaimConfig | None = None,
) -> FeatureStore:
    """The cached features of one corpus split (`source`), extracting what is missing. Warm
    start (the source's listing digest is as recorded): the manifest's arrays and a stat per
    shard file; otherwise, or with `verify` (nothing recorded trusted), a full scan, then
    `extract_features`."""
    issues = issues or Issues()
    listing = source.listing()
    manifest = splits_dir(cache_root) / f"{manifest_key(listing.name, settings)}.json"
    store = None if verify else _warm_store(manifest, listing.digest, max_open_shards)
    if store is not None:
        report(store, issues, scan=True)
    else:
        before = len(issues.skips)
        utts = source.scan(issues)
        if not utts:
            raise DataError(listing.folder, "no usable utterances", source.empty_detail)
        store = extract_features(
            utts,
            settings,
            cache_root,
            issues,
            workers,
            shard_size,
            progress,
            f"features {source.split}",
            on_shard_done,
            verify,
            folder=listing.folder,
            name=listing.name,
            listing=listing.digest,
            scan_skips=issues.skips[before:],
            max_open_shards=max_open_shards,
            claim_config=claim_config,
        )
    warn_if_stale(cache_root)
    return store


def _warm_store(manifest: Path, listing: str, max_open_shards: int) -> FeatureStore | None:
    """The manifest's store when it was made for this listing and every shard file checks
    out, else None (damaged shards marked for re-extraction, with a warning naming the file)."""
    if not manifest.is_file():
        return None
    try:
        store = FeatureStore(manifest, max_open_shards)
    except DataError as e:
        log.warning("feature cache: %s; rebuilding it", e)
        manifest.unlink(missing_ok=True)  # not committed: rewritten even when it looks current
        return None
    if store.listing != listing:
        return None
    damaged = store.check()
    for k, path, problem in damaged:
        log.warning("feature cache: %s: %s; re-extracting its shard", path, problem)
        invalidate(store.paths(k), path)
        OPEN_SHARDS.forget(str(store.paths(k).npy))
    if damaged:
        return None
    touch(manifest)
    return store
