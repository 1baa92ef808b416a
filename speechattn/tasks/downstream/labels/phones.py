"""`target: phones`: the phone of every 10 ms frame (the study's phone tasks), from the
alignments file (`data.alignments`, CPC format), travelling with the features."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from speechattn.data.features import expand_to_labels
from speechattn.errors import ConfigError, MissingFileError
from speechattn.tasks.downstream.features import SplitFeatures
from speechattn.tasks.downstream.labels import LabelSource, register


class MissingAlignmentsError(MissingFileError):
    """A phone task whose alignments file does not exist."""


@register("phones")
class PhoneLabels(LabelSource):
    per_frame = True

    def num_classes(self) -> int | None:
        return getattr(self.datamodule, "num_phones", None)

    def check_classes(self, task: str) -> int:
        n = self.num_classes()
        if not n:
            dm = self.datamodule
            raise ConfigError(
                f"task {task}: the corpus yielded no phone classes from "
                f"{dm.label_files.path(dm.cfg.alignments)}"
            )
        return n

    def missing_alignments(self, task: str, setting: str | None, path: Path | None) -> None:
        missing_alignments(f"task {task}", setting, path)

    def check_split(self, split: SplitFeatures, task: str) -> None:
        if split.phones is None:
            raise ConfigError(f"task {task}: the corpus provides no phone labels")

    def check_lengths(self, split: SplitFeatures, downsample: int, tolerance: int) -> None:
        check_label_lengths(split, downsample, tolerance)

    def of_split(self, split: SplitFeatures, i: int) -> Tensor:
        return split.phones_of(i)  # (T,)

    def of_batch(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        if batch.get("phones") is None:
            raise ConfigError("the downstream task needs phone labels; the batches have none")
        return batch["phones"], batch["phone_lengths"]


def missing_alignments(
    who: str,
    setting: str | None,
    path: Path | None,
    error: type[Exception] = MissingAlignmentsError,
) -> NoReturn:
    """Refuse a job (`who`) that needs phone labels: data.alignments unset, or `path` absent."""
    if setting is None:
        raise ConfigError(
            f"{who} needs frame-level phone labels, but data.alignments is null; "
            f"set it to the CPC-format file (converted_aligned_phones.txt)"
        )
    raise error(
        f"{who} needs frame-level phone labels: {path} does not exist. For real "
        f"LibriSpeech put the CPC alignments there (converted_aligned_phones.txt with "
        f"train_split.txt / test_split.txt) or point data.alignments_dir at them"
    )


def check_label_lengths(split: SplitFeatures, downsample: int, tolerance: int) -> None:
    """Raise (naming the utterance) when phone labels and features disagree beyond `tolerance`,
    before any training: `expand_to_labels` on zero-width stand-ins."""
    if split.phone_lengths is None:
        return
    for start in range(0, len(split), 256):
        stop = min(start + 256, len(split))
        lengths = split.lengths[start:stop]
        dummy = torch.zeros(stop - start, int(lengths.max()), 1)  # (B, T', 1)
        ids, label_lengths = split.utt_ids[start:stop], split.phone_lengths[start:stop]
        expand_to_labels(dummy, downsample, label_lengths, ids, tolerance, lengths=lengths)
