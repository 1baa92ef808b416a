"""Lightning data modules: the shared corpus machinery and `PretrainDataModule` (unlabelled
crops); `LabelledDataModule` builds on them in `speechattn.data.labelled`.

Both resolve the corpus (the built-in one is built on first use), extract features into the
cache in `setup` (every DDP rank, sharing the shards through claims: docs/multinode.md),
compute normalisation statistics on their training utterances and serve padded,
length-bucketed batches (`speechattn.data.datasets`). Bad input follows `cfg.on_error`:
"error" raises `DataError` naming the file; "skip" drops the utterance (logged at the end of
`setup`, kept in `.skipped`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, RandomSampler, SequentialSampler

from speechattn.data.cache import ExtractionSettings, FeatureStore, open_source
from speechattn.data.cache.store import register_reader
from speechattn.data.config import DataConfig, local_rank
from speechattn.data.corpora import Corpus, FolderCorpus
from speechattn.data.datasets import FeatureDataset, LengthBucketBatchSampler, collate
from speechattn.data.errors import DataError, Issues, Skip
from speechattn.data.features import HOP_LENGTH, SAMPLE_RATE, FeatureConfig, Normalizer
from speechattn.data.librispeech import LabelFiles, read_split_list
from speechattn.errors import ConfigError
from speechattn.utils import derive_seed

log = logging.getLogger(__name__)


def resolve_root(cfg: DataConfig) -> Path:
    """The corpus root: `cfg.root`, or the built-in corpus (built on first use)."""
    if cfg.root:
        root = Path(cfg.root).expanduser().resolve()
        if not root.is_dir():  # before anything looks for label files inside it
            raise DataError(root, "corpus root not found", f"data.root={cfg.root} is not a folder")
        return root
    if cfg.corpus != "embedded":
        raise ConfigError(f"data.root is required for corpus={cfg.corpus}")
    from speechattn.data.synth import ensure_embedded_corpus

    return ensure_embedded_corpus(
        cfg.cache_root(), cfg.synth_speakers, cfg.synth_utterances_per_speaker, cfg.synth_seed,
        workers=cfg.extract_workers, progress=cfg.progress,
    )  # fmt: skip


def extraction_settings(cfg: DataConfig) -> ExtractionSettings:
    return ExtractionSettings(
        features=FeatureConfig(n_mels=cfg.n_mels, deltas=cfg.deltas),
        sample_rate_policy=cfg.sample_rate_policy,
        min_frames=cfg.min_frames,
        dtype=cfg.cache_dtype,
    )


class _Items(ConcatDataset):
    """Concatenation of per-split `FeatureDataset`s with their `lengths` and `utt_ids`."""

    def __init__(self, parts: list[FeatureDataset]) -> None:
        super().__init__(parts)
        self.parts = parts
        self.lengths = (
            np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
        )

    @property
    def utt_ids(self) -> list[str]:
        return [u for p in self.parts for u in p.utt_ids]


class _CorpusDataModule(L.LightningDataModule):
    """Shared machinery: corpus resolution, scanning, feature cache, loaders."""

    def __init__(
        self, cfg: DataConfig | dict[str, Any] | None = None, normalizer: Normalizer | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg if isinstance(cfg, DataConfig) else DataConfig(**(cfg or {}))
        self.issues = Issues(self.cfg.on_error)
        self._given_normalizer = normalizer
        self._normalizer: Normalizer | None = None
        self._root: Path | None = None
        self._corpus: Corpus | None = None
        self._splits: dict[str, FeatureStore] = {}
        self._ready = False
        self.datasets: dict[str, _Items] = {}

    @property
    def feature_dim(self) -> int:
        return self.cfg.feature_dim

    @property
    def feature_config(self) -> FeatureConfig:
        """Log-mel settings (store `feature_config.to_dict()` to recompute features later)."""
        return extraction_settings(self.cfg).features

    @property
    def normalizer(self) -> Normalizer:
        if self._normalizer is None:
            raise RuntimeError(
                f"{type(self).__name__}.normalizer is set by setup(); call setup() first"
            )
        return self._normalizer

    @property
    def skipped(self) -> list[Skip]:
        """Every utterance left out under `on_error=skip`, with file and reason."""
        return list(self.issues.skips)

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = resolve_root(self.cfg)
        return self._root

    @property
    def label_files(self) -> LabelFiles:
        c = self.cfg
        folder = Path(c.alignments_dir).expanduser().resolve() if c.alignments_dir else self.root
        return LabelFiles(folder, c.alignments, c.phone_set, c.train_list, c.test_list)

    @property
    def corpus(self) -> Corpus:
        """The corpus reader (`speechattn.data.corpora`): splits, speakers, phone labels."""
        if self._corpus is None:
            c = self.cfg
            if c.corpus == "folder":
                self._corpus = FolderCorpus(
                    self.root, self.label_files, c.num_phones, c.speaker_level
                )
            elif c.corpus == "lhotse":
                from speechattn.data.lhotse_corpus import LhotseCorpus

                self._corpus = LhotseCorpus(
                    self.root, self.label_files, c.num_phones, c.label_tolerance
                )
            else:
                self._corpus = Corpus(self.root, self.label_files, c.num_phones)
        return self._corpus

    def _split(self, split: str) -> FeatureStore:
        """Cached features of one split (extracted on first use); progress bars on each node's
        local rank 0 only."""
        if split not in self._splits:
            c = self.cfg
            self._splits[split] = open_source(
                self.corpus.source(split), extraction_settings(c), c.cache_root(), self.issues,
                workers=c.extraction_workers, shard_size=c.shard_size,
                progress=c.progress and local_rank() == 0, verify=c.verify_cache,
                max_open_shards=c.max_open_shards, claim_config=c.claim_config(),
            )  # fmt: skip
            register_reader(self._splits[split].manifest)  # gc keeps it while this job runs
        return self._splits[split]

    def prepare_data(self) -> None:
        """Build the built-in corpus on first use (each node's local rank 0, before a barrier);
        features are extracted in `setup` by every rank."""
        self._root = resolve_root(self.cfg)

    def _normalizer_from(self, parts: list[tuple[FeatureStore, list[int]]]) -> Normalizer:
        if self._given_normalizer is not None:
            return self._given_normalizer
        count, total, total_sq = 0, np.zeros(self.feature_dim), np.zeros(self.feature_dim)
        for store, indices in parts:  # one pass over each store's statistics files
            if len(indices):
                n, s, s2 = store.sums(indices)
                count, total, total_sq = count + n, total + s, total_sq + s2
        if self.cfg.normalization == "none":
            return Normalizer.identity(self.feature_dim)
        return Normalizer.from_sums(count, total, total_sq, self.cfg.normalization)

    def _finish_setup(self) -> None:
        self._ready = True
        self.issues.log_summary(log)

    def _loader(self, dataset: _Items, shuffle: bool) -> DataLoader:
        c = self.cfg
        if shuffle:
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(c.seed))
        else:
            sampler = SequentialSampler(dataset)
        batches = LengthBucketBatchSampler(
            sampler, c.batch_size, False, dataset.lengths, c.bucket_size, shuffle, c.seed
        )
        workers = c.loader_workers
        return DataLoader(
            dataset, batch_sampler=batches, collate_fn=collate, num_workers=workers,
            pin_memory=c.pin_memory, persistent_workers=workers > 0,
            prefetch_factor=c.prefetch_factor if workers > 0 else None,
        )  # fmt: skip

    def _dataset(self, name: str) -> _Items:
        if not self._ready:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for dataloaders")
        return self.datasets[name]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("train"), shuffle=True)

    def describe(self) -> dict[str, Any]:
        """Corpus facts for result metadata: root, utterances and seconds of audio (10 ms
        frames) per role, skips."""
        frame_s = HOP_LENGTH / SAMPLE_RATE
        return {
            "corpus": self.cfg.corpus,
            "root": str(self.root),
            **{f"{k}_utterances": len(v) for k, v in self.datasets.items()},
            **{
                f"{k}_seconds": round(float(v.lengths.sum()) * frame_s, 1)
                for k, v in self.datasets.items()
            },
            "skipped": len(self.issues.skips),
        }


def validation_ids(ids: Sequence[str], fraction: float, cap: int | None, seed: int) -> set[str]:
    """Pretraining's validation utterances among `ids`: the `fraction` of them (at least one
    where two or more are given, never all), at most `cap` (None: no cap), chosen by the
    smallest seeded hash of their id: the set depends on the ids and the seed alone, and a
    grown corpus changes it little."""
    if fraction <= 0 or len(ids) < 2:
        return set()
    n = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    if cap is not None:
        n = min(n, cap)
    ranks = np.fromiter((derive_seed(seed, "validation", u) for u in ids), np.uint64, len(ids))
    return {ids[i] for i in np.argsort(ranks, kind="stable")[:n]}


class PretrainDataModule(_CorpusDataModule):
    """Unlabelled batches for masked acoustic modelling.

    Training items are random crops of at most `max_frames` frames; validation items the first
    `max_frames` frames of a seeded `pretrain_val_fraction` of the utterances, at most
    `max_val_utterances` of them (`validation_ids`: stable as the corpus grows). Shorter
    utterances are used whole (padded in the batch; `padding_mask` marks the padding).
    """

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        c, excluded = self.cfg, set()
        test_list = self.label_files.path(c.test_list)  # kept out of pretraining
        if c.pretrain_exclude_test and test_list is not None and test_list.is_file():
            excluded = set(read_split_list(test_list))
        n_excluded = 0
        usable = {}  # split -> its utterance ids not excluded
        for split in c.pretrain_splits:
            store = self._split(split)
            usable[split] = [u for u in store.utt_ids if u not in excluded]
            n_excluded += len(store) - len(usable[split])
        everything = [u for ids in usable.values() for u in ids]
        held = validation_ids(everything, c.pretrain_val_fraction, c.max_val_utterances, c.seed)
        if len(held) < round(c.pretrain_val_fraction * len(everything)):
            log.info(
                "validation: %d utterances (data.max_val_utterances=%s; pretrain_val_fraction=%s "
                "would hold out %d)", len(held), c.max_val_utterances, c.pretrain_val_fraction,
                round(c.pretrain_val_fraction * len(everything)),
            )  # fmt: skip
        parts: dict[str, list[tuple[FeatureStore, list[int]]]] = {"train": [], "val": []}
        for split, ids in usable.items():
            store = self._split(split)
            parts["train"].append((store, [store.position[u] for u in ids if u not in held]))
            parts["val"].append((store, [store.position[u] for u in ids if u in held]))
        if not any(idx for _, idx in parts["train"]):
            raise DataError(
                self.root, "no pretraining utterances", f"splits {c.pretrain_splits} are empty"
            )
        self._normalizer = self._normalizer_from(parts["train"])
        norm, mf = self._normalizer, c.max_frames
        self.datasets = {
            role: _Items([FeatureDataset(s, i, norm, mf, role == "train") for s, i in ps])
            for role, ps in parts.items()
        }
        log.info(
            "pretraining data: %d train / %d val utterances from %s (%d labelled-test utterances excluded)",
            len(self.datasets["train"]), len(self.datasets["val"]), self.cfg.pretrain_splits, n_excluded,
        )  # fmt: skip
        self._finish_setup()

    def val_dataloader(self) -> DataLoader | list:
        ds = self._dataset("val")
        return self._loader(ds, shuffle=False) if len(ds) else []
