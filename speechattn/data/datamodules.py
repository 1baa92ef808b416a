"""Lightning data modules: `PretrainDataModule` (unlabelled crops) and `LabelledDataModule`
(speaker and phone labels for the probes), and `build_datamodule`. `setup` extracts features
on every DDP rank (the shards shared through claims: docs/multinode.md); bad input follows
`cfg.on_error` (docs/data.md, "Bad input")."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, RandomSampler, SequentialSampler

from speechattn.data.cache import ExtractionSettings, FeatureStore, open_source
from speechattn.data.cache.store import register_reader
from speechattn.data.config import DataConfig, local_rank
from speechattn.data.corpora import Corpus, FolderCorpus, LhotseCorpus
from speechattn.data.datasets import FeatureDataset, LengthBucketBatchSampler, collate
from speechattn.data.errors import DataError, Issues, Skip
from speechattn.data.features import HOP_LENGTH, SAMPLE_RATE, FeatureConfig, Normalizer
from speechattn.data.librispeech import LabelFiles, read_split_list
from speechattn.errors import ConfigError
from speechattn.utils import derive_seed, plain

log = logging.getLogger(__name__)


def resolve_root(cfg: DataConfig) -> Path:
    """The corpus root: `cfg.root`, or the built-in corpus (built on first use)."""
    if cfg.root:
        root = Path(cfg.root).expanduser().resolve()
        if not root.is_dir():  # before anything looks for label files inside it
            raise DataError(root, "corpus root not found", f"data.root={cfg.root} is not a folder")
        return root
    from speechattn.data.synth import ensure_embedded_corpus

    return ensure_embedded_corpus(
        cfg.cache_root(),
        cfg.synth_speakers,
        cfg.synth_utterances_per_speaker,
        cfg.synth_seed,
        workers=cfg.extract_workers,
        progress=cfg.progress,
    )


def extraction_settings(cfg: DataConfig) -> ExtractionSettings:
    return ExtractionSettings(
        features=FeatureConfig(n_mels=cfg.n_mels, deltas=cfg.deltas),
        sample_rate_policy=cfg.sample_rate_policy,
        min_frames=cfg.min_frames,
        dtype=cfg.cache_dtype,
    )


class _Items(ConcatDataset):
    """Per-split `FeatureDataset`s concatenated, with their `lengths` and `utt_ids`."""

    def __init__(self, parts: list[FeatureDataset]) -> None:
        super().__init__(parts)
        self.lengths = np.concatenate([p.lengths for p in parts] or [np.zeros(0, np.int64)])

    @property
    def utt_ids(self) -> list[str]:
        return [u for p in self.datasets for u in p.utt_ids]


class _CorpusDataModule(L.LightningDataModule):
    """Corpus resolution, scanning, feature cache and loaders."""

    def __init__(
        self, cfg: DataConfig | dict[str, Any] | None = None, normalizer: Normalizer | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg if isinstance(cfg, DataConfig) else DataConfig(**(cfg or {}))
        self.issues = Issues(self.cfg.on_error)
        self._given_normalizer = normalizer
        self._normalizer: Normalizer | None = None
        self._splits: dict[str, FeatureStore] = {}
        self.datasets: dict[str, _Items] = {}  # set last by `setup`

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
            msg = f"{type(self).__name__}.normalizer is set by setup(); call setup() first"
            raise RuntimeError(msg)
        return self._normalizer

    @property
    def skipped(self) -> list[Skip]:
        """Every utterance left out under `on_error=skip`, with file and reason."""
        return list(self.issues.skips)

    @cached_property
    def root(self) -> Path:
        return resolve_root(self.cfg)

    @property
    def label_files(self) -> LabelFiles:
        c = self.cfg
        folder = Path(c.alignments_dir).expanduser().resolve() if c.alignments_dir else self.root
        return LabelFiles(folder, c.alignments, c.phone_set, c.train_list, c.test_list)

    @cached_property
    def corpus(self) -> Corpus:
        """The corpus reader (`speechattn.data.corpora`): splits, speakers, phone labels."""
        c, common = self.cfg, (self.root, self.label_files, self.cfg.num_phones)
        if c.corpus == "folder":
            return FolderCorpus(*common, c.speaker_level)
        if c.corpus == "lhotse":
            return LhotseCorpus(*common, c.label_tolerance)
        return Corpus(*common)

    def _split(self, split: str) -> FeatureStore:
        """Cached features of one split (extracted on first use)."""
        if split not in self._splits:
            c = self.cfg
            self._splits[split] = open_source(
                self.corpus.source(split),
                extraction_settings(c),
                c.cache_root(),
                self.issues,
                workers=c.extraction_workers,
                shard_size=c.shard_size,
                progress=c.progress and local_rank() == 0,
                verify=c.verify_cache,
                max_open_shards=c.max_open_shards,
                claim_config=c.claim_config(),
            )
            register_reader(self._splits[split].manifest)  # gc keeps it while this job runs
        return self._splits[split]

    def prepare_data(self) -> None:
        """Build the built-in corpus on first use (each node's local rank 0, before a barrier);
        features are extracted in `setup` by every rank."""
        _ = self.root

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

    def _loader(self, dataset: _Items, shuffle: bool) -> DataLoader:
        c = self.cfg
        rng = torch.Generator().manual_seed(c.seed)
        sampler = RandomSampler(dataset, generator=rng) if shuffle else SequentialSampler(dataset)
        batches = LengthBucketBatchSampler(
            sampler, c.batch_size, False, dataset.lengths, c.bucket_size, shuffle, c.seed
        )
        workers = c.loader_workers
        return DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=c.pin_memory,
            persistent_workers=workers > 0,
            prefetch_factor=c.prefetch_factor if workers > 0 else None,
        )

    def _dataset(self, name: str) -> _Items:
        if not self.datasets:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for dataloaders")
        return self.datasets[name]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("train"), shuffle=True)

    def describe(self) -> dict[str, Any]:
        """Corpus facts for result metadata: root, utterances and seconds of audio (10 ms
        frames) per role, skips."""
        out = {"corpus": self.cfg.corpus, "root": str(self.root)}
        out |= {f"{k}_utterances": len(v) for k, v in self.datasets.items()}
        for k, v in self.datasets.items():
            out[f"{k}_seconds"] = round(float(v.lengths.sum()) * (HOP_LENGTH / SAMPLE_RATE), 1)
        return out | {"skipped": len(self.issues.skips)}


def _held_out_count(n: int, fraction: float, cap: int | None = None) -> int:
    """How many of `n` items a held-out `fraction` takes: at least one where two or more are
    given, never all, at most `cap` (None: no cap)."""
    if fraction <= 0 or n < 2:
        return 0
    k = min(n - 1, max(1, round(fraction * n)))
    return k if cap is None else min(k, cap)


def validation_ids(ids: Sequence[str], fraction: float, cap: int | None, seed: int) -> set[str]:
    """Pretraining's validation utterances among `ids` (`_held_out_count` of them), chosen by
    the smallest seeded hash of their id: the set depends on the ids and the seed alone, and a
    grown corpus changes it little."""
    if not (n := _held_out_count(len(ids), fraction, cap)):
        return set()
    ranks = np.fromiter((derive_seed(seed, "validation", u) for u in ids), np.uint64, len(ids))
    return {ids[i] for i in np.argsort(ranks, kind="stable")[:n]}


class PretrainDataModule(_CorpusDataModule):
    """Unlabelled batches for masked acoustic modelling: training items are random crops of at
    most `max_frames` frames, validation items the first `max_frames` of `validation_ids`;
    shorter utterances are used whole (padded in the batch)."""

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        c, excluded = self.cfg, set()
        test_list = self.label_files.path(c.test_list)  # kept out of pretraining
        if c.pretrain_exclude_test and test_list is not None and test_list.is_file():
            excluded = set(read_split_list(test_list))
        stores = {split: self._split(split) for split in c.pretrain_splits}
        usable = {k: [u for u in s.utt_ids if u not in excluded] for k, s in stores.items()}
        n_excluded = sum(len(s) - len(usable[k]) for k, s in stores.items())
        everything = [u for ids in usable.values() for u in ids]
        held = validation_ids(everything, c.pretrain_val_fraction, c.max_val_utterances, c.seed)
        if len(held) < (wanted := round(c.pretrain_val_fraction * len(everything))):
            log.info(
                "validation: %d utterances (data.max_val_utterances=%s; pretrain_val_fraction=%s "
                "would hold out %d)",
                len(held),
                c.max_val_utterances,
                c.pretrain_val_fraction,
                wanted,
            )
        parts: dict[str, list[tuple[FeatureStore, list[int]]]] = {"train": [], "val": []}
        for split, ids in usable.items():
            store = stores[split]
            parts["train"].append((store, [store.position[u] for u in ids if u not in held]))
            parts["val"].append((store, [store.position[u] for u in ids if u in held]))
        if not any(idx for _, idx in parts["train"]):
            detail = f"splits {c.pretrain_splits} are empty"
            raise DataError(self.root, "no pretraining utterances", detail)
        self._normalizer = self._normalizer_from(parts["train"])
        norm, mf = self._normalizer, c.max_frames
        self.datasets = {
            role: _Items([FeatureDataset(s, i, norm, mf, role == "train") for s, i in ps])
            for role, ps in parts.items()
        }
        log.info(
            "pretraining data: %d train / %d val utterances from %s (%d labelled-test utterances excluded)",
            len(self.datasets["train"]),
            len(self.datasets["val"]),
            self.cfg.pretrain_splits,
            n_excluded,
        )
        self.issues.log_summary(log)

    def val_dataloader(self) -> DataLoader | list:
        ds = self._dataset("val")
        return self._loader(ds, shuffle=False) if len(ds) else []


class LabelledDataModule(_CorpusDataModule):
    """Speaker and phone labels for downstream probes (train/dev/test: docs/data.md,
    "Formats"). Phone labels more than `label_tolerance` frames off the features are bad input;
    within it they are trimmed or padded with -100.

    After `setup`: `speakers` (class -> speaker id), `phone_set`, `normalizer`, `datasets`
    ("train", "dev", "test").
    """

    def __init__(
        self, cfg: DataConfig | dict[str, Any] | None = None, normalizer: Normalizer | None = None
    ) -> None:
        super().__init__(cfg, normalizer)
        self.speakers: list[str] = []
        self.phone_set: list[str] = []

    @property
    def num_speakers(self) -> int:
        return len(self.speakers)

    @property
    def num_phones(self) -> int:
        return len(self.phone_set)

    def _role_ids(self, available: dict[str, tuple[str, int]]) -> tuple[list[str], list[str]]:
        """Train and test utterance ids per the configured lists / folders, checked."""
        c, files = self.cfg, self.label_files
        skipped = self.issues.skipped_ids
        labelled = [u for u, (split, _) in available.items() if split in c.labelled_splits]

        def from_list(name: str) -> list[str]:
            listed = read_split_list(path := files.folder / name)
            for u in listed:
                if u not in available and u not in skipped:  # skipped ones were reported
                    detail = f"not found in {c.labelled_splits}"
                    error = DataError(path, "utterance not in the corpus", detail, u)
                    self.issues.report(error, "lists")
            return [u for u in listed if u in available]

        if c.test_list is not None:
            test = from_list(c.test_list)
        else:
            test = sorted(u for u, (split, _) in available.items() if split in c.test_splits)
        test_set = set(test)
        if c.train_list is not None:
            train = from_list(c.train_list)
            both = "utterance in both train and test lists"
            for u in [u for u in train if u in test_set]:
                self.issues.report(DataError(files.path(c.train_list), both, "", u), "lists")
            train = [u for u in train if u not in test_set]
        else:
            train = sorted(u for u in labelled if u not in test_set)
        if unused := len(set(labelled) - set(train) - test_set):
            log.info(
                "%d utterances of %s are in neither the train nor the test list (unused)",
                unused,
                c.labelled_splits,
            )
        return train, test

    def _phones(self, ids: list[str], lengths: dict[str, int]) -> dict[str, np.ndarray]:
        """Checked phone labels of `ids` (reports missing / mismatched / unknown symbols)."""
        c = self.cfg
        if c.alignments is None:
            self.phone_set = []
            return {}
        labels, self.phone_set, path = self.corpus.phone_labels(ids, self.issues)
        skipped = self.issues.skipped_ids
        out = {}
        for u in ids:
            if (lab := labels.get(u)) is None:
                if u not in skipped:
                    error = DataError(path, "missing alignment", "no line for this utterance", u)
                    self.issues.report(error, "labels")
            elif abs(len(lab) - lengths[u]) <= c.label_tolerance:
                out[u] = lab
            else:
                detail = f"{len(lab)} label frames, the audio gives {lengths[u]} frames"
                detail += f" (snip-edges), tolerance {c.label_tolerance}"
                error = DataError(path, "alignment length mismatch", detail, u)
                self.issues.report(error, "labels")
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        c = self.cfg
        available: dict[str, tuple[str, int]] = {}  # utt_id -> (split, position in its store)
        splits = c.labelled_splits + (c.test_splits if c.test_list is None else [])
        for split in dict.fromkeys(splits):
            store = self._split(split)
            available.update((u, (split, i)) for i, u in enumerate(store.utt_ids))
        train, test = self._role_ids(available)
        lengths = {
            u: int(self._splits[s].lengths[i]) for u in train + test for s, i in [available[u]]
        }
        phones = self._phones(train + test, lengths)
        if c.alignments is not None:
            train, test = [u for u in train if u in phones], [u for u in test if u in phones]
        train, dev = self._dev_split(train)
        if not train or not test:
            detail = f"train {len(train)}, test {len(test)} utterances"
            raise DataError(self.label_files.folder, "empty train or test set", detail)
        speaker = {u: self.corpus.speaker_of(u) for u in train + dev + test}
        self.speakers = sorted(set(speaker.values()), key=_numeric_first)
        if unseen := sorted({speaker[u] for u in test} - {speaker[u] for u in train}):
            log.warning(
                "%d test speakers never occur in train (speaker tasks cannot get them right): %s",
                len(unseen),
                unseen[:10],
            )
        classes = {s: i for i, s in enumerate(self.speakers)}

        def by_split(ids: list[str]) -> list[tuple[FeatureStore, list[int], list[str]]]:
            grouped: dict[str, list[str]] = defaultdict(list)
            for u in ids:
                grouped[available[u][0]].append(u)
            return [
                (self._splits[k], [available[u][1] for u in us], us) for k, us in grouped.items()
            ]

        def items(ids: list[str], random_crop: bool) -> _Items:
            return _Items(
                [
                    FeatureDataset(
                        store,
                        indices,
                        self._normalizer,
                        c.labelled_max_frames,
                        random_crop,
                        [classes[speaker[u]] for u in us],
                        [phones.get(u, np.zeros(0, np.int16)) for u in us],
                    )
                    for store, indices, us in by_split(ids)
                ]
            )

        self._normalizer = self._normalizer_from([p[:2] for p in by_split(train)])
        self._eval_train = items(train, False)  # uncropped, for feature extraction
        roles = {"train": train, "dev": dev, "test": test}
        self.datasets = {role: items(ids, role == "train") for role, ids in roles.items()}
        mf = c.labelled_max_frames
        if cropped := sum(1 for u in train + dev + test if mf and lengths[u] > mf):
            log.warning(
                "%d labelled utterances are longer than labelled_max_frames=%d and are cropped",
                cropped,
                mf,
            )
        log.info(
            "labelled data: %d train / %d dev / %d test utterances, %d speakers, %d phone classes",
            len(train),
            len(dev),
            len(test),
            self.num_speakers,
            self.num_phones,
        )
        self.issues.log_summary(log)

    def _dev_split(self, train: list[str]) -> tuple[list[str], list[str]]:
        """(train, dev): dev a seeded `dev_fraction` of each speaker's utterances."""
        by_speaker: dict[str, list[str]] = defaultdict(list)
        for u in train:
            by_speaker[self.corpus.speaker_of(u)].append(u)
        dev: set[str] = set()
        for k, speaker in enumerate(sorted(by_speaker, key=_numeric_first)):
            ids = sorted(by_speaker[speaker])
            order = np.random.default_rng(self.cfg.seed * 100003 + k).permutation(len(ids))
            dev.update(ids[i] for i in order[: _held_out_count(len(ids), self.cfg.dev_fraction)])
        return [u for u in train if u not in dev], [u for u in train if u in dev]

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("dev"), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("test"), shuffle=False)

    def extraction_dataloader(self, split: str) -> DataLoader:
        """Deterministic loader (no shuffling, no random crops) of "train", "dev" or "test"."""
        if split not in ("train", "dev", "test"):
            raise ConfigError(f"split must be train, dev or test, found {split!r}")
        dataset = self._dataset(split)
        return self._loader(self._eval_train if split == "train" else dataset, shuffle=False)


def _numeric_first(speaker: str) -> tuple[int, str]:
    return (int(speaker), speaker) if speaker.isdigit() else (1 << 62, speaker)


def build_datamodule(config: Any, kind: str = "pretrain") -> L.LightningDataModule:
    """The data module of a job from its `data` config (a DataConfig, dict or config node):
    `PretrainDataModule` (kind "pretrain") or `LabelledDataModule` (kind "labelled"). A
    `_target_` instantiates any other DataModule that follows the batch contract of
    docs/ARCHITECTURE.md instead (bring your own data; the tests use synthetic speech)."""
    if not isinstance(config, DataConfig) and "_target_" in config:
        from hydra.utils import instantiate

        return instantiate(config)
    if kind not in ("pretrain", "labelled"):
        raise ValueError(f"kind must be pretrain or labelled, not {kind!r}")
    if not isinstance(config, DataConfig):
        config = DataConfig(**plain(config))
    return PretrainDataModule(config) if kind == "pretrain" else LabelledDataModule(config)
