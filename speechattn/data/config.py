"""`DataConfig`: every data-layer setting and its default (the `data` group's Hydra schema:
`conf/data/embedded.yaml` is these defaults, `librispeech.yaml` states what differs).

Tasks build it with `DataConfig(**cfg.data)`; lists coming from Hydra (`ListConfig`) are turned
into plain lists and every choice is validated here, so a typo fails at start-up, not mid-run.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speechattn.data.claims import ClaimConfig
from speechattn.utils import default_cache_root

CORPUS_CHOICES = ("embedded", "librispeech")
NORMALIZATION_CHOICES = ("global", "utterance", "none")
SAMPLE_RATE_POLICIES = ("resample", "error")
CACHE_DTYPES = ("float16", "float32")


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a SLURM or taskset share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _env_count(name: str) -> int | None:
    """A positive count from the environment ("4(x2)", SLURM's per-node form, reads 4)."""
    value = os.environ.get(name, "").split("(")[0]
    return int(value) if value.isdigit() and int(value) > 0 else None


def rank_cpus() -> int:
    """CPU cores for this process's own work when every DDP rank works at once: torchrun
    (`LOCAL_WORLD_SIZE`) starts a node's ranks on the same cores, so they share them; a SLURM
    task has `SLURM_CPUS_PER_TASK` of its own; otherwise the cores are shared among
    `SLURM_NTASKS_PER_NODE` tasks, or `WORLD_SIZE` ranks (Lightning's own launcher: exact on
    one node, too many on several, which errs towards fewer workers)."""
    cpus = usable_cpus()
    if ranks := _env_count("LOCAL_WORLD_SIZE"):
        return cpus // ranks
    if own := _env_count("SLURM_CPUS_PER_TASK"):
        return min(cpus, own)
    ranks = _env_count("SLURM_NTASKS_PER_NODE") or _env_count("WORLD_SIZE") or 1
    return cpus // ranks


def local_rank() -> int:
    """This process's rank on its node (`LOCAL_RANK`, set by Lightning and torchrun; else 0)."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else 0


@dataclass
class DataConfig:
    """Data-layer configuration (flat, so Hydra overrides read `data.batch_size=8`)."""

    # ---- corpus ----
    corpus: str = "embedded"  # embedded (built-in eSpeak corpus) | librispeech
    root: str | None = (
        None  # corpus root; embedded + None: build/reuse the default corpus in the cache
    )
    alignments_dir: str | None = None  # folder with the label/split files below; None: the root
    cache_dir: str | None = None  # None: $SPEECHATTN_CACHE or ~/.cache/speechattn
    # Built-in corpus size when `root` is None (changing them builds another corpus).
    synth_speakers: int = 24
    synth_utterances_per_speaker: int = 25
    synth_seed: int = 0

    # ---- which split folders / lists feed which role ----
    pretrain_splits: list[str] = field(default_factory=lambda: ["synth-clean"])
    labelled_splits: list[str] = field(default_factory=lambda: ["synth-clean"])
    train_list: str | None = "train_split.txt"  # None: every labelled utterance not in test
    test_list: str | None = "test_split.txt"  # None: test = all utterances of `test_splits`
    test_splits: list[str] = field(default_factory=list)
    alignments: str | None = "converted_aligned_phones.txt"  # None: no phone labels
    phone_set: str | None = "phone_set.txt"  # missing file: classes are "0".."num_phones-1"
    num_phones: int | None = None  # without phone_set.txt (CPC LibriSpeech labels: 41)
    dev_fraction: float = 0.1  # seeded, per speaker, taken from train
    pretrain_exclude_test: bool = True  # keep labelled test audio out of pretraining
    pretrain_val_fraction: float = 0.05  # held out from pretraining for a validation loss

    # ---- features (docs/data.md) ----
    n_mels: int = 80
    deltas: bool = False  # append deltas and delta-deltas (F = 3 * n_mels)
    normalization: str = "global"  # global (train-split mean/std) | utterance (CMVN) | none
    sample_rate_policy: str = "resample"  # non-16 kHz audio: resample (with a warning) | error
    cache_dtype: str = "float16"  # on-disk feature precision

    # ---- batching ----
    batch_size: int = 8  # pretraining utterances per step (short runs gain from more updates)
    # DataLoader worker processes (they also stack and mask pretraining batches); null: one per
    # CPU core this process may use, minus one for the training loop, at most 8
    num_workers: int | None = 0
    pin_memory: bool = False  # page-locked batches: asynchronous copies to a GPU
    prefetch_factor: int = 2  # batches each worker keeps ready (with num_workers > 0)
    # pretraining batches padded to a multiple of this many model frames (30 ms): a compiled
    # step sees one shape per bucket, and SDPA gets masks it need not pad (GPU: 64)
    pad_to_multiple: int = 1
    max_frames: int = 1500  # pretraining random crop, 10 ms frames (model limit: 3072)
    labelled_max_frames: int | None = 3000  # longer labelled utterances are cropped (logged)
    min_frames: int = 10  # shorter utterances are bad input ("too short")
    bucket_size: int = 50  # batches per length-sorting pool
    label_tolerance: int = 2  # 10 ms frames labels may differ from the audio before it is an error

    # ---- robustness and bookkeeping ----
    on_error: str = "error"  # error | skip (counted and reported)
    seed: int = 0
    # feature-extraction processes per process (per DDP rank: every rank extracts); None: this
    # rank's share of the node's cores (`rank_cpus`), at most 8
    extract_workers: int | None = None
    # utterances per cache shard on average (unit of resume, of parallel work and of what a
    # changed file re-extracts); shards hold at most 3x as many
    shard_size: int = 64
    # checksum every cached file at start-up (re-extracting damaged ones); otherwise a file is
    # checksummed only when its size or mtime no longer match what was recorded at extraction
    verify_cache: bool = False
    # open shard files per process (each DataLoader worker too): reads go through an LRU of
    # this many descriptors, so `ulimit -n` need not grow with the corpus
    max_open_shards: int = 32
    progress: bool = True

    # ---- pretraining validation (beside pretrain_val_fraction above) ----
    # at most this many utterances held out (null: no cap): 5 % of LibriSpeech 960 h would be
    # 14k utterances read before the first step and at every validation; 1000 are 20 batches
    # of 50. Chosen by a seeded hash of the utterance id: the same set for the same corpus
    # and seed, and a grown corpus changes it little (`datamodules.validation_ids`)
    max_val_utterances: int | None = 1000

    # ---- several processes extracting into one cache (DDP ranks, nodes; docs/multinode.md) ----
    # Every process claims the shards nobody holds (a claim file beside the shard) and waits for
    # the others'. Defaults live in `speechattn.data.claims.ClaimConfig`.
    claim_heartbeat_s: float = ClaimConfig.heartbeat_s  # a process touches its claims this often
    # a claim untouched this long is a dead (or frozen) holder's and another process takes its
    # shard over; at least 3 x claim_heartbeat_s
    claim_expiry_s: float = ClaimConfig.expiry_s
    # give up (`ClaimTimeout`, naming the shards, their holders and claim files) when none of
    # the shards other processes hold finishes for this long
    cache_wait_timeout_s: float = ClaimConfig.wait_timeout_s
    cache_wait_log_s: float = ClaimConfig.log_every_s  # a waiting process logs progress this often

    def __post_init__(self) -> None:
        for name in ("pretrain_splits", "labelled_splits", "test_splits"):
            value = getattr(self, name)
            setattr(self, name, [value] if isinstance(value, str) else [str(v) for v in value])
        for name, choices in (
            ("corpus", CORPUS_CHOICES),
            ("normalization", NORMALIZATION_CHOICES),
            ("sample_rate_policy", SAMPLE_RATE_POLICIES),
            ("cache_dtype", CACHE_DTYPES),
            ("on_error", ("error", "skip")),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"data.{name} must be one of {choices}, found {getattr(self, name)!r}"
                )
        if self.corpus == "librispeech" and not self.root:
            raise ValueError(
                "data.root is required for corpus=librispeech (the LibriSpeech folder)"
            )
        for name in (
            "batch_size", "max_frames", "min_frames", "shard_size", "bucket_size",
            "prefetch_factor", "pad_to_multiple", "max_open_shards",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, found {getattr(self, name)}")
        if self.max_val_utterances is not None and self.max_val_utterances < 1:
            raise ValueError(
                f"data.max_val_utterances must be >= 1 or null (no cap), "
                f"found {self.max_val_utterances}"
            )
        if not 0 <= self.dev_fraction < 1 or not 0 <= self.pretrain_val_fraction < 1:
            raise ValueError("data.dev_fraction and data.pretrain_val_fraction must be in [0, 1)")
        if self.max_frames < self.min_frames:
            raise ValueError(
                f"data.max_frames ({self.max_frames}) < data.min_frames ({self.min_frames})"
            )
        if self.test_list is None and not self.test_splits:
            raise ValueError(
                "data.test_list is null, so data.test_splits must name the test folders"
            )
        if self.extract_workers is not None and self.extract_workers < 1:
            raise ValueError(
                f"data.extract_workers must be >= 1 or null (from the CPU count), "
                f"found {self.extract_workers}"
            )
        try:
            self.claim_config()
        except ValueError as e:
            raise ValueError(
                f"data.claim_heartbeat_s={self.claim_heartbeat_s}, "
                f"data.claim_expiry_s={self.claim_expiry_s}, "
                f"data.cache_wait_timeout_s={self.cache_wait_timeout_s}, "
                f"data.cache_wait_log_s={self.cache_wait_log_s}: {e}"
            ) from None

    @property
    def loader_workers(self) -> int:
        """`num_workers`, with null resolved from the CPUs this process may use."""
        if self.num_workers is not None:
            return max(0, int(self.num_workers))
        return max(1, min(8, usable_cpus() - 1))

    @property
    def extraction_workers(self) -> int:
        """`extract_workers`, with null resolved: this rank's share of the node's cores (every
        rank extracts at the same time), at most 8."""
        if self.extract_workers is not None:
            return self.extract_workers
        return max(1, min(8, rank_cpus()))

    def claim_config(self) -> ClaimConfig:
        """The claims' timing (`speechattn.data.claims`) from the settings above."""
        return ClaimConfig(
            heartbeat_s=self.claim_heartbeat_s,
            expiry_s=self.claim_expiry_s,
            wait_timeout_s=self.cache_wait_timeout_s,
            log_every_s=self.cache_wait_log_s,
        )

    @property
    def feature_dim(self) -> int:
        return self.n_mels * (3 if self.deltas else 1)

    def cache_root(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_root()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
