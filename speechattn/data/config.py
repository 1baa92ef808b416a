"""`DataConfig`: every data-layer setting and its default (the `data` group's Hydra schema),
validated at start-up."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speechattn.data.claims import ClaimConfig
from speechattn.data.errors import ON_ERROR_CHOICES
from speechattn.data.features import Normalizer
from speechattn.errors import ConfigError, is_int, is_number, require
from speechattn.utils import default_cache_root

CORPUS_CHOICES = ("embedded", "librispeech", "folder", "lhotse")
NORMALIZATION_CHOICES = Normalizer.MODES
SAMPLE_RATE_POLICIES = ("resample", "error")
CACHE_DTYPES = ("float16", "float32")


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a SLURM or taskset share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _env_count(name: str) -> int | None:
    """A positive count from the environment ("4(x2)", SLURM's per-node form, reads 4)."""
    value = os.environ.get(name, "").split("(")[0]
    return int(value) if value.isdigit() and int(value) > 0 else None


def rank_cpus() -> int:
    """CPU cores for this process's own work when every DDP rank works at once: the usable cores
    shared by torchrun's `LOCAL_WORLD_SIZE` ranks; a SLURM task's `SLURM_CPUS_PER_TASK`; else
    shared by `SLURM_NTASKS_PER_NODE` tasks or `WORLD_SIZE` ranks (erring towards fewer)."""
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

    # ---- corpus (docs/data.md) ----
    corpus: str = "embedded"  # embedded (built-in eSpeak corpus) | librispeech | folder | lhotse
    # corpus root (lhotse: the manifests' folder); embedded + None: the built-in corpus
    root: str | None = None
    # lhotse: a CutSet file; root defaults to its folder, empty pretrain/labelled splits to it
    cuts: str | None = None
    # folder: the path level naming the speaker (0: the first folder under root, -1: the one
    # holding the file); None: no speakers (pretraining needs none)
    speaker_level: int | None = None
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
    # None: no phone labels; lhotse: the supervisions' alignment kind ("phone")
    alignments: str | None = "converted_aligned_phones.txt"
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
    # hash every audio file and checksum every cached file at start-up; otherwise only files
    # whose size or mtime (audio: or ctime) moved are
    verify_cache: bool = False
    # open shard files per process (each DataLoader worker too): `ulimit -n` need not grow
    max_open_shards: int = 32
    progress: bool = True

    # pretraining validation: at most this many utterances held out (null: no cap; 5 % of
    # LibriSpeech 960 h would be 14k), chosen by a seeded hash of the id
    max_val_utterances: int | None = 1000

    # ---- several processes extracting into one cache (docs/multinode.md) ----
    claim_heartbeat_s: float = ClaimConfig.heartbeat_s  # a process touches its claims this often
    # a claim untouched this long is a dead (or frozen) holder's and another process takes its
    # shard over; at least 3 x claim_heartbeat_s
    claim_expiry_s: float = ClaimConfig.expiry_s
    # give up (`ClaimTimeout`) when none of the shards others hold finishes for this long
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
            ("on_error", ON_ERROR_CHOICES),
        ):
            value = getattr(self, name)
            require(value in choices, f"data.{name}", value, f"one of {', '.join(choices)}")
        if self.corpus == "lhotse":
            self._lhotse_defaults()
        if self.corpus in ("librispeech", "folder") and not self.root:
            raise ConfigError(f"data.root is required for corpus={self.corpus} (the corpus folder)")
        ok = self.speaker_level is None or is_int(self.speaker_level)
        rule = "an integer (a folder level), or null"
        require(ok, "data.speaker_level", self.speaker_level, rule)
        nullable = {
            "max_val_utterances": 1,
            "labelled_max_frames": 1,
            "extract_workers": 1,
            "num_workers": 0,
        }
        for name in (
            "batch_size",
            "max_frames",
            "min_frames",
            "shard_size",
            "bucket_size",
            "prefetch_factor",
            "pad_to_multiple",
            "max_open_shards",
            "n_mels",
            *nullable,
        ):
            value, low = getattr(self, name), nullable.get(name, 1)
            ok = (value is None and name in nullable) or (is_int(value) and value >= low)
            rule = f"an integer >= {low}" + (", or null" if name in nullable else "")
            require(ok, f"data.{name}", value, rule)
        ok = is_int(self.label_tolerance) and self.label_tolerance >= 0
        require(ok, "data.label_tolerance", self.label_tolerance, "an integer >= 0 (10 ms frames)")
        # downstream's early stopping needs a dev set: 0 would leave it empty
        ok = is_number(self.dev_fraction) and 0 < self.dev_fraction < 1
        require(ok, "data.dev_fraction", self.dev_fraction, "in (0, 1), e.g. 0.1")
        ok = is_number(self.pretrain_val_fraction) and 0 <= self.pretrain_val_fraction < 1
        require(ok, "data.pretrain_val_fraction", self.pretrain_val_fraction, "in [0, 1)")
        ok = self.max_frames >= self.min_frames
        require(ok, "data.max_frames", self.max_frames, f">= data.min_frames={self.min_frames}")
        if self.test_list is None and not self.test_splits:
            msg = "data.test_list is null, so data.test_splits must name the test folders"
            raise ConfigError(msg)
        try:
            self.claim_config()
        except ValueError as e:
            raise ConfigError(
                f"data.claim_heartbeat_s={self.claim_heartbeat_s}, "
                f"data.claim_expiry_s={self.claim_expiry_s}, "
                f"data.cache_wait_timeout_s={self.cache_wait_timeout_s}, "
                f"data.cache_wait_log_s={self.cache_wait_log_s}: {e}"
            ) from None

    def _lhotse_defaults(self) -> None:
        """`cuts` stands for root (its folder) and for the splits left empty (its file)."""
        if self.cuts:
            cuts = Path(self.cuts).expanduser()
            self.root = self.root or str(cuts.parent)
            self.pretrain_splits = self.pretrain_splits or [cuts.name]
            self.labelled_splits = self.labelled_splits or [cuts.name]
        if not self.root or not self.pretrain_splits:
            raise ConfigError(
                "corpus=lhotse needs data.cuts=CUTSET_FILE, or data.root=MANIFEST_FOLDER with "
                "data.pretrain_splits (and data.labelled_splits) naming its splits"
            )

    @property
    def loader_workers(self) -> int:
        """`num_workers`, with null resolved from the CPUs this process may use."""
        if self.num_workers is not None:
            return max(0, int(self.num_workers))
        return max(1, min(8, usable_cpus() - 1))

    @property
    def extraction_workers(self) -> int:
        """`extract_workers`, with null resolved (see the field)."""
        return max(1, min(8, rank_cpus())) if self.extract_workers is None else self.extract_workers

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
