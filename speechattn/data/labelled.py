"""`LabelledDataModule`: speaker and phone labels for the downstream probes (train/dev/test),
built on the corpus machinery of `speechattn.data.datamodules`."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from speechattn.data.config import DataConfig
from speechattn.data.datamodules import _CorpusDataModule, _Items
from speechattn.data.datasets import FeatureDataset
from speechattn.data.errors import DataError
from speechattn.data.features import Normalizer
from speechattn.data.librispeech import read_split_list
from speechattn.errors import ConfigError

log = logging.getLogger(__name__)


class LabelledDataModule(_CorpusDataModule):
    """Speaker and phone labels for downstream probes.

    train/test come from the split lists in `alignments_dir` (or, with `test_list: null`, test is
    every utterance of `test_splits`); dev is a seeded `dev_fraction` of train, per speaker.
    Phone labels (10 ms frames) are checked against the feature length: a difference above
    `label_tolerance` is bad input; within it, labels are trimmed or padded with -100.

    Attributes after `setup`: `num_speakers`, `speakers` (class -> speaker id), `num_phones`,
    `phone_set`, `normalizer`, `datasets` ("train", "dev", "test"), `skipped`.
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
            path = files.path(name)
            assert path is not None
            ids = []
            for u in read_split_list(path):
                if u in available:
                    ids.append(u)
                elif u not in skipped:  # skipped ones were already reported
                    detail = f"not found in {c.labelled_splits}"
                    error = DataError(path, "utterance not in the corpus", detail, u)
                    self.issues.report(error, "lists")
            return ids

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
        unused = len(set(labelled) - set(train) - test_set)
        if unused:
            log.info(
                "%d utterances of %s are in neither the train nor the test list (unused)",
                unused, c.labelled_splits,
            )  # fmt: skip
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
            lab = labels.get(u)
            if lab is None:
                if u not in skipped:
                    error = DataError(path, "missing alignment", "no line for this utterance", u)
                    self.issues.report(error, "labels")
                continue
            if abs(len(lab) - lengths[u]) > c.label_tolerance:
                self.issues.report(
                    DataError(path, "alignment length mismatch",
                              f"{len(lab)} label frames, the audio gives {lengths[u]} frames "
                              f"(snip-edges), tolerance {c.label_tolerance}", u),
                    "labels",
                )  # fmt: skip
                continue
            out[u] = lab
        return out

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        available: dict[str, tuple[str, int]] = {}  # utt_id -> (split, position in its store)
        extra = self.cfg.test_splits if self.cfg.test_list is None else []
        for split in dict.fromkeys(self.cfg.labelled_splits + extra):
            store = self._split(split)
            available.update((u, (split, i)) for i, u in enumerate(store.utt_ids))
        roles, lengths, phones = self._roles(available)
        self.speakers = sorted(
            {self.corpus.speaker_of(u) for ids in roles.values() for u in ids}, key=_numeric_first
        )
        unseen = sorted(
            {self.corpus.speaker_of(u) for u in roles["test"]}
            - {self.corpus.speaker_of(u) for u in roles["train"]}
        )
        if unseen:
            log.warning(
                "%d test speakers never occur in train (speaker tasks cannot get them right): %s",
                len(unseen), unseen[:10],
            )  # fmt: skip
        self._build_datasets(roles, available, phones)
        mf = self.cfg.labelled_max_frames
        cropped = sum(1 for ids in roles.values() for u in ids if mf and lengths[u] > mf)
        if cropped:
            log.warning(
                "%d labelled utterances are longer than labelled_max_frames=%d and are cropped",
                cropped, mf,
            )  # fmt: skip
        log.info(
            "labelled data: %d train / %d dev / %d test utterances, %d speakers, %d phone classes",
            len(roles["train"]), len(roles["dev"]), len(roles["test"]), self.num_speakers,
            self.num_phones,
        )  # fmt: skip
        self._finish_setup()

    def _roles(
        self, available: dict[str, tuple[str, int]]
    ) -> tuple[dict[str, list[str]], dict[str, int], dict[str, np.ndarray]]:
        """The utterance ids of train/dev/test (with usable labels), every one's length in
        10 ms frames, and the checked phone labels (empty without alignments)."""
        train, test = self._role_ids(available)
        lengths = {
            u: int(self._splits[available[u][0]].lengths[available[u][1]]) for u in train + test
        }
        phones = self._phones(train + test, lengths)
        if self.cfg.alignments is not None:
            train, test = [u for u in train if u in phones], [u for u in test if u in phones]
        train, dev = self._dev_split(train)
        if not train or not test:
            detail = f"train {len(train)}, test {len(test)} utterances"
            raise DataError(self.label_files.folder, "empty train or test set", detail)
        return {"train": train, "dev": dev, "test": test}, lengths, phones

    def _build_datasets(
        self,
        roles: dict[str, list[str]],
        available: dict[str, tuple[str, int]],
        phones: dict[str, np.ndarray],
    ) -> None:
        """`datasets` (train with random crops, dev, test) and the uncropped train set for
        feature extraction, normalised with the train split's statistics."""
        speaker_class = {s: i for i, s in enumerate(self.speakers)}

        def by_split(ids: list[str]) -> dict[str, list[str]]:
            grouped: dict[str, list[str]] = defaultdict(list)
            for u in ids:
                grouped[available[u][0]].append(u)
            return grouped

        def items(ids: list[str], random_crop: bool) -> _Items:
            return _Items([
                FeatureDataset(
                    self._splits[split], [available[u][1] for u in us], self._normalizer,
                    self.cfg.labelled_max_frames, random_crop,
                    [speaker_class[self.corpus.speaker_of(u)] for u in us],
                    [phones.get(u, np.zeros(0, np.int16)) for u in us],
                )
                for split, us in by_split(ids).items()
            ])  # fmt: skip

        train = by_split(roles["train"]).items()
        self._normalizer = self._normalizer_from(
            [(self._splits[split], [available[u][1] for u in us]) for split, us in train]
        )
        self.datasets = {
            "train": items(roles["train"], True),
            "dev": items(roles["dev"], False),
            "test": items(roles["test"], False),
        }
        self._eval_train = items(roles["train"], False)

    def _dev_split(self, train: list[str]) -> tuple[list[str], list[str]]:
        by_speaker: dict[str, list[str]] = defaultdict(list)
        for u in train:
            by_speaker[self.corpus.speaker_of(u)].append(u)
        dev: set[str] = set()
        for k, speaker in enumerate(sorted(by_speaker, key=_numeric_first)):
            ids = sorted(by_speaker[speaker])
            dev |= _held_out(ids, self.cfg.dev_fraction, self.cfg.seed * 100003 + k)
        return [u for u in train if u not in dev], [u for u in train if u in dev]

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("dev"), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("test"), shuffle=False)

    def extraction_dataloader(self, split: str) -> DataLoader:
        """Deterministic loader (no shuffling, no random crops) of "train", "dev" or "test"."""
        if split not in ("train", "dev", "test"):
            raise ConfigError(f"split must be train, dev or test, found {split!r}")
        self._dataset(split)
        return self._loader(
            self._eval_train if split == "train" else self.datasets[split], shuffle=False
        )


def _numeric_first(speaker: str) -> tuple[int, str]:
    return (int(speaker), speaker) if speaker.isdigit() else (1 << 62, speaker)


def _held_out(ids: list[str], fraction: float, seed: int) -> set[str]:
    """A seeded ~`fraction` of `ids` (at least one where two or more are given, never all)."""
    if fraction <= 0 or len(ids) < 2:
        return set()
    order = np.random.default_rng(seed).permutation(len(ids))
    n = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    return {ids[i] for i in order[:n]}
