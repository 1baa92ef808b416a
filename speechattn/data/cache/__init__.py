"""On-disk feature cache: extract once, in parallel, resumable, shared by content: shards
keyed by the settings and their audio's sha256, one manifest per corpus folder, atomic writes
with a commit marker last, `python -m speechattn.data.cache ls|gc`. Identity, integrity,
layout and start-up cost: docs/cache.md; several processes: docs/multinode.md.
"""

from speechattn.data.cache.extract import extract_features, open_source, open_split
from speechattn.data.cache.shards import (
    CACHE_VERSION,
    ExtractionSettings,
    file_sha256,
    manifest_key,
    plan_shards,
    shard_dir,
    splits_dir,
)
from speechattn.data.cache.store import DEFAULT_MAX_OPEN_SHARDS, OPEN_SHARDS, FeatureStore

__all__ = [
    "CACHE_VERSION",
    "DEFAULT_MAX_OPEN_SHARDS",
    "OPEN_SHARDS",
    "ExtractionSettings",
    "FeatureStore",
    "extract_features",
    "file_sha256",
    "manifest_key",
    "open_source",
    "open_split",
    "plan_shards",
    "shard_dir",
    "splits_dir",
]
