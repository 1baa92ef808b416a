"""`target: speaker`: who speaks, one label per utterance (the study's speaker tasks); the
labels travel with the batches and the feature cache (`SplitFeatures.speakers`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from speechattn.errors import ConfigError
from speechattn.tasks.downstream.features import SplitFeatures
from speechattn.tasks.downstream.labels import LabelSource, register


@register("speaker")
class SpeakerLabels(LabelSource):
    def num_classes(self) -> int | None:
        return getattr(self.datamodule, "num_speakers", None)

    def check_classes(self, task: str) -> int:
        n = self.num_classes() or 0
        if n < 2:
            raise ConfigError(f"task {task} needs at least 2 speakers, the corpus has {n}")
        return n

    def check_split(self, split: SplitFeatures, task: str) -> None:
        if split.speakers is None:
            raise ConfigError(f"task {task}: the corpus provides no speaker labels")

    def of_split(self, split: SplitFeatures, i: int) -> Tensor:
        return split.speakers[i]  # ()

    def of_batch(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        if batch.get("speaker") is None:
            raise ConfigError("the downstream task needs speaker labels; the batches have none")
        return batch["speaker"], None
