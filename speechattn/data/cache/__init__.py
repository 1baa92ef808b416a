"""On-disk feature cache: extract once, in parallel, resumable, shared by content (docs/cache.md).

Layout (`layout.py`; user guide: docs/cache.md):

    <cache_root>/features/shards/<settings key>/<shard key>.{npy,stats.npy,json}
    <cache_root>/features/splits/<manifest key>.{npz,json}

Identity. A shard is a run of a corpus folder's utterances (in id order); its key hashes the
settings and its utterances' (id, size, sha256 of the audio bytes). Shard boundaries fall
after each utterance whose hash(id) % shard_size == 0 (at most 3 x shard_size utterances), so
adding, removing or changing a file changes its shard (or two neighbours) and no other. A
manifest, keyed by (absolute folder, settings), holds the folder's per-utterance index as
arrays, its shard keys and their files' records, and every audio file's (relative path, size,
mtime_ns, ctime_ns, sha256): the fingerprint memo. An unchanged corpus, or one renamed within
its file system, is never re-read; a file whose size, mtime or ctime moved is re-hashed (the
ctime catches an edit under a restored mtime) and re-extracted only when its bytes changed.

Writes are atomic and durable (temporary name, fsync, rename, fsync of the folder). A shard
counts as done once its json commit marker exists, written last, and is consistent (a damaged
one is removed and the shard re-extracted); a manifest once its json exists, written after its
npz, and its index fits the shards' markers and files (else it is rebuilt). A killed
extraction leaves at most temporary files (removed on the next run) and a rerun extracts only
the shards without a marker. Processes extracting into one cache at the same time (DDP ranks,
nodes) claim each shard through `speechattn.data.claims` and wait for the others' shards: each
shard is extracted once, and one of them writes the manifest (docs/multinode.md). Bad audio is recorded in the shard's marker and the manifest, so
a rerun reports it again without decoding.

Integrity ("checksums once"). Each data file's size, shape, dtype, sha256 and mtime_ns are
recorded as it is written. Start-up stats every shard file against the manifest's records; a
file whose size or mtime moved is checksummed against its marker, kept (its mtime recorded)
when the bytes match, else re-extracted with a warning naming it. `verify` (`data.verify_cache`)
checksums every file and re-hashes every audio file at start-up. A reader checks size, mtime and .npy header whenever it opens
a shard; one changed since start-up is marked for re-extraction and raises `DataError` naming
the file ("rerun the same command").

Descriptors. Reads go through a process-wide LRU of at most `max_open_shards` open files
(`store.py`), whatever the corpus size.

Start-up (`open_source`, for any corpus reader's split; `open_split` for a LibriSpeech-layout
folder): the source's listing (a folder: one `os.scandir` walk with a stat per file) compared
with the digest the manifest recorded, then the manifest's arrays; statistics in one pass over the
shards' `.stats.npy` (`FeatureStore.sums`). `python -m speechattn.data.cache ls|gc` lists and
removes what no corpus uses (`gc.py`).
"""

from speechattn.data.cache.extract import extract_features, open_source, open_split
from speechattn.data.cache.integrity import file_sha256
from speechattn.data.cache.layout import (
    CACHE_VERSION,
    ExtractionSettings,
    manifest_key,
    shard_dir,
    splits_dir,
)
from speechattn.data.cache.shards import plan_shards
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
