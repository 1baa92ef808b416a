"""`python -m speechattn.data.cache ls|gc [--cache-dir D]`: list the feature cache by corpus
folder, and remove what no corpus uses (`gc --dry-run` shows it first)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from speechattn.data.cache.gc import GRACE_S, collect, survey
from speechattn.errors import MissingFileError, add_debug_flag, command_line_errors
from speechattn.utils import default_cache_root


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= length:
            return f"{s / length:.0f} {unit} ago"
    return "just now"


def ls(cache_root: Path) -> None:
    s = survey(cache_root)
    print(f"feature cache {s.root}: {_size(s.total_bytes)}")
    print(f"{'status':<10} {'utterances':>10} {'shards':>7} {'size':>9}  {'last used':<12} folder")
    for m in s.manifests:
        folder = m.folder + ("" if m.exists else "  (missing)")
        print(
            f"{m.status:<10} {m.utterances:>10} {len(m.shards):>7} "
            f"{_size(s.shard_bytes(set(m.shards))):>9}  {_ago(m.last_used):<12} {folder}"
        )
        if m.status == "changed":
            print(f"{'':<10} {len(m.in_use)} of {len(m.shards)} shards still match their files")
    for plan in s.plans:
        print(f"extracting: {plan.name} (updated {_ago(plan.stat().st_mtime)})")
    unused = s.unreferenced
    print(f"unreferenced shards: {len(unused)}, {_size(sum(x.bytes for x in unused))}")
    for folder, size, newest in s.old_entries:
        print(f"old layout (v2): {folder}, {_size(size)}, written {_ago(newest)}")
    print(f"gc would free about {_size(s.stale_bytes)}: python -m speechattn.data.cache gc")
    missing = [m for m in s.manifests if m.status == "missing"]
    if missing:
        size = _size(s.shard_bytes({k for m in missing for k in m.shards}))
        print(f"{len(missing)} corpora whose folder is missing keep {size}: gc --forget-missing")


def gc(cache_root: Path, dry_run: bool, grace_s: float, forget_missing: bool = False) -> None:
    r = collect(cache_root, dry_run, grace_s, forget_missing=forget_missing)
    verb = "would remove" if dry_run else "removed"
    print(
        f"{verb} {len(r['manifests'])} stale manifests, {len(r['shards'])} unreferenced shards, "
        f"{len(r['old_entries'])} old-layout entries, {len(r['temp_files'])} temporary files: "
        f"{_size(r['bytes'])}"
    )
    for path in r["manifests"] + r["old_entries"]:
        print(f"  {path}")
    if r["kept"]:
        print(
            f"kept {r['kept']} unused shards or entries: younger than {grace_s / 3600:g} h or claimed"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m speechattn.data.cache", description=__doc__)
    p.add_argument("command", choices=("ls", "gc"))
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $SPEECHATTN_CACHE or ~/.cache/speechattn)",
    )
    p.add_argument("--dry-run", action="store_true", help="gc: only list what would go")
    p.add_argument(
        "--grace-hours",
        type=float,
        default=GRACE_S / 3600,
        help="gc keeps unused files younger than this (an extraction may be running)",
    )
    p.add_argument(
        "--forget-missing",
        action="store_true",
        help="gc: also remove corpora whose folder is not there (by default kept: a "
        "renamed folder or an unmounted drive may come back)",
    )
    add_debug_flag(p)
    args = p.parse_args(argv)
    root = (args.cache_dir or default_cache_root()).expanduser()
    with command_line_errors(args.debug, p.prog):
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            given = "--cache-dir" if args.cache_dir else "the default cache root"
            raise MissingFileError(
                f"{root} ({given}) {what}: no feature cache there; --cache-dir names the "
                "folder data.cache_dir (or $SPEECHATTN_CACHE) points to"
            )
        if args.command == "ls":
            ls(root)
        else:
            gc(root, args.dry_run, args.grace_hours * 3600, args.forget_missing)


if __name__ == "__main__":  # pragma: no cover
    main()
