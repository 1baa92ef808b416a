"""The downstream task and its probe: `TaskConfig` (the `task` group's schema), the cached
features as a dataset, and `DownstreamProbe`, the model's `Probe` trained by Lightning.

Shape letters: B batch, N cached layers, T' upstream frames, T 10 ms label frames, D hidden
dim, C classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from torchmetrics import Metric

from speechattn.model.probes import Probe
from speechattn.tasks.downstream.features import SplitFeatures
from speechattn.tasks.downstream.labels import LabelSource, check_level, label_source
from speechattn.utils import IGNORE_INDEX, lengths_to_padding_mask


@dataclass
class TaskConfig:
    """One downstream task (the `task` group's Hydra schema). The defaults are the default
    task, `speaker_utterance`; the other `conf/task/NAME.yaml` state what differs."""

    name: str = "speaker_utterance"
    # what the probe predicts: a label source of speechattn/tasks/downstream/labels/
    # (speaker | phones | pitch | a file you add there, docs/extending.md)
    target: str = "speaker"
    level: str = "utterance"  # utterance (one label per utterance) | frame (one per 10 ms frame)
    pooling: str = "mean"  # utterance level only: mean | fused (FusedAttentionPool)
    pooling_scale: str = "value"  # fused: scores / sqrt(size of V) | key: of Q, K
    hidden_layers: int = 0  # 0 = linear probe
    hidden_dim: int = 768  # the study's phoneme MLP width
    dropout: float = 0.0
    batch_size: int = 8  # utterances (~3k frames at 10 ms): more updates per epoch
    lr: float = 1e-2  # linear on mean-pooled features: few updates per epoch (~54)
    weight_decay: float = 0.0
    # conf/trainer/probe.yaml and conf/downstream.yaml feed these to the trainer and early
    # stopping. Utterance-level epochs are cheap (one vector per utterance) and the dev split
    # small and noisy.
    max_epochs: int = 40
    patience: int = 10  # epochs without a better dev accuracy before stopping

    def __post_init__(self) -> None:
        check_level(self.name, self.target, self.level)

    def labels(self, datamodule: Any = None) -> LabelSource:
        """This task's label source, bound to the data module that provides the labels."""
        return label_source(self.target)(datamodule)


# ----------------------------------------------------------------------------- data


class ProbeDataset(Dataset):
    """Items of one cached split: hidden (N, T', D) plus the task's labels at its level.

    `labels` is the task's label source bound to the corpus (`TaskConfig.labels(datamodule)`);
    None binds it to nothing, which serves the sources whose labels travel with the features.
    """

    def __init__(
        self, split: SplitFeatures, task: TaskConfig, labels: LabelSource | None = None
    ) -> None:
        self.labels = labels if labels is not None else task.labels()
        self.labels.check_split(split, task.name)
        self.split, self.task = split, task
        self.hidden = [split.hidden(i) for i in range(len(split))]  # float32 once, not per epoch

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, Any]:
        labels = self.labels.item(self.split, i, self.task.level)  # () or (T,)
        return {"hidden": self.hidden[i], "utt_id": self.split.utt_ids[i], "labels": labels}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad a list of items: hidden (B, N, T', D), lengths (B,), padding_mask (B, T'),
    labels (B,) or (B, T) padded with -100, label_lengths (B,), utt_ids."""
    N, _, D = items[0]["hidden"].shape
    lengths = torch.tensor([it["hidden"].size(1) for it in items])
    hidden = torch.zeros(len(items), N, int(lengths.max()), D)
    for b, it in enumerate(items):
        hidden[b, :, : lengths[b]] = it["hidden"]
    padding_mask = lengths_to_padding_mask(lengths, hidden.size(2))  # (B, T')
    utt_ids = [it["utt_id"] for it in items]
    batch = {"hidden": hidden, "lengths": lengths, "padding_mask": padding_mask, "utt_ids": utt_ids}
    labels = [it["labels"] for it in items]
    if labels[0].dim() == 0:
        batch["labels"] = torch.stack(labels)
    else:
        batch["labels"] = pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX).long()
        batch["label_lengths"] = torch.tensor([len(y) for y in labels])
    return batch


# ----------------------------------------------------------------------------- model


class DownstreamProbe(Probe, L.LightningModule):
    """The task's `Probe`, trained with cross-entropy on frozen features (Lightning)."""

    def __init__(
        self,
        task: TaskConfig,
        input_dim: int,
        num_layers: int,
        num_classes: int,
        downsample: int,
        tolerance: int,
    ) -> None:
        sizes = {
            "input_dim": input_dim,
            "num_layers": num_layers,
            "num_classes": num_classes,
            "downsample": downsample,
            "tolerance": tolerance,
        }
        super().__init__(
            task.level,
            *sizes.values(),
            pooling=task.pooling,
            pooling_scale=task.pooling_scale,
            hidden_layers=task.hidden_layers,
            hidden_dim=task.hidden_dim,
            dropout=task.dropout,
        )
        self.save_hyperparameters({"task": asdict(task), **sizes})
        self.task = task
        metric = task.labels().metric(num_classes)
        self.train_acc, self.dev_acc, self.test_acc = metric.clone(), metric.clone(), metric.clone()

    def _step(self, batch: dict[str, Any], metric: Metric) -> Tensor:
        flat_logits, flat_labels = self.aligned(self(batch), batch["labels"])
        metric.update(flat_logits.detach(), flat_labels)
        return self.loss(flat_logits, flat_labels)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._step(batch, self.train_acc)
        B = len(batch["utt_ids"])
        self.log("train_loss", loss, prog_bar=True, batch_size=B)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True, batch_size=B)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss = self._step(batch, self.dev_acc)
        B = len(batch["utt_ids"])
        self.log("dev_loss", loss, batch_size=B)
        self.log("dev_acc", self.dev_acc, prog_bar=True, batch_size=B)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, self.test_acc)
        self.log("test_acc", self.test_acc, batch_size=len(batch["utt_ids"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.task.lr, weight_decay=self.task.weight_decay)
