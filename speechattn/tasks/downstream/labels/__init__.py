"""Label sources of the downstream tasks: what a probe predicts and where its labels come from.

A task's `target` names its source: the file of this folder named after it, a `LabelSource`
registered with `@register("<name>")`, imported on first use by `label_source(name)`
(docs/extending.md). What depends on the task's level is done once, in `LabelSource`.
Shape letters: U utterances in a split, B batch, T 10 ms label frames.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from speechattn.errors import ConfigError
from speechattn.utils import IGNORE_INDEX, lengths_to_padding_mask

if TYPE_CHECKING:
    from speechattn.tasks.downstream.features import SplitFeatures

LEVELS = ("utterance", "frame")  # one label per utterance | one per 10 ms frame


class LabelSource:
    """One kind of label, bound to the data module that provides it (None in unit tests of
    sources whose labels travel with the features)."""

    name: ClassVar[str] = ""  # set by `register`: the `target` of the tasks that use it
    per_frame: ClassVar[bool] = False  # True: one label per 10 ms frame (frame tasks only)

    def __init__(self, datamodule: Any = None) -> None:
        self.datamodule = datamodule

    def num_classes(self) -> int | None:
        """Classes the corpus gives; None when the data module does not say."""
        raise NotImplementedError(f"label source {self.name} does not count its classes")

    def check_classes(self, task: str) -> int:
        """`num_classes()`, refused (naming the task) when fewer than two arrived."""
        n = self.num_classes()
        if n is None or n < 2:
            raise ConfigError(
                f"task {task}: the corpus gives {n} {self.name} classes; a probe needs at least 2"
            )
        return n

    def missing_alignments(self, task: str, setting: str | None, path: Path | None) -> None:
        """The phone-alignments file is unset or absent: sources that need it raise."""

    def check_split(self, split: SplitFeatures, task: str) -> None:
        """Raise (naming the task) when the cached `split` lacks this source's labels."""

    def check_lengths(self, split: SplitFeatures, downsample: int, tolerance: int) -> None:
        """Raise (naming the utterance) when labels and features disagree before training."""

    def metric(self, num_classes: int) -> Metric:
        """What dev/test are scored with (and model selection maximises)."""
        return MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)

    def utterance_label(self, utt_id: str) -> int:
        """The class of one utterance (per-utterance sources that read corpus metadata)."""
        raise NotImplementedError(f"label source {self.name} has no utterance_label")

    def of_split(self, split: SplitFeatures, i: int) -> Tensor:
        """Utterance i's labels: () per utterance, (T,) per frame."""
        return torch.tensor(self.utterance_label(split.utt_ids[i]))

    def of_batch(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        """A data-layer batch's labels: (B,) and None, or (B, T) padded with IGNORE_INDEX and
        their lengths (B,)."""
        return torch.tensor([self.utterance_label(u) for u in batch["utt_ids"]]), None

    def item(self, split: SplitFeatures, i: int, level: str) -> Tensor:
        """Utterance i's labels at `level`: () for utterance tasks, (T,) for frame tasks."""
        labels = self.of_split(split, i)
        if level == "frame" and labels.dim() == 0:
            return labels.repeat(int(split.input_lengths[i]))
        return labels

    def batch(self, batch: dict[str, Any], level: str) -> tuple[Tensor, Tensor | None]:
        """`of_batch` at `level`: frame tasks of per-utterance sources get each label on every
        valid frame, (B, T) with IGNORE_INDEX on padding, and lengths (B,)."""
        labels, lengths = self.of_batch(batch)
        if level == "frame" and lengths is None:
            T = int(batch["lengths"].max())
            padding = lengths_to_padding_mask(batch["lengths"], T)  # (B, T)
            labels = labels[:, None].expand(-1, T).masked_fill(padding, IGNORE_INDEX)
            lengths = batch["lengths"]
        return labels, lengths

    def scored(self, split: SplitFeatures, level: str) -> int:
        """What accuracy is taken over in `split`: utterances, or labelled 10 ms frames."""
        if level == "utterance":
            return len(split)
        return sum(int(self.item(split, i, level).numel()) for i in range(len(split)))


_SOURCES: dict[str, type[LabelSource]] = {}


def register(name: str):
    """Class decorator: make a `LabelSource` subclass the source of `target: name`."""

    def add(cls: type[LabelSource]) -> type[LabelSource]:
        if not (isinstance(cls, type) and issubclass(cls, LabelSource)):
            raise TypeError(f"label source {name}: {cls!r} is not a LabelSource subclass")
        if name in _SOURCES and _SOURCES[name] is not cls:
            raise ValueError(f"label source {name} is registered twice")
        cls.name = name
        _SOURCES[name] = cls
        return cls

    return add


def available() -> list[str]:
    """The label sources of this folder (file names; nothing is imported)."""
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py") if p.stem != "__init__")


def label_source(name: str) -> type[LabelSource]:
    """The source registered as `name`, importing `<name>.py` of this folder on first use."""
    if name not in _SOURCES and str(name).isidentifier():
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    if name not in _SOURCES:
        raise ConfigError(
            f"task target={name!r}: no such label source; choose one of {', '.join(available())} "
            f"or add speechattn/tasks/downstream/labels/{name}.py (docs/extending.md)"
        )
    return _SOURCES[name]


def check_level(task: str, target: str, level: str) -> None:
    """Refuse a level the source cannot give (naming the task)."""
    if level not in LEVELS:
        raise ConfigError(f"task {task}: level must be utterance or frame, not {level!r}")
    if level == "utterance" and label_source(target).per_frame:
        raise ConfigError(f"task {task}: utterance level needs one label per utterance")


__all__ = ["LEVELS", "LabelSource", "available", "check_level", "label_source", "register"]
