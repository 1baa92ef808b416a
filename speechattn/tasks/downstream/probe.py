"""The downstream task and its probe: `TaskConfig` (the `task` group's schema), the cached
features as a dataset, and `DownstreamProbe`, the model's `Probe` trained by Lightning.

Shape letters: B batch, N cached layers, T' upstream frames, T 10 ms label frames, D hidden
dim, C classes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy

from speechattn.model.probes import Probe
from speechattn.tasks.downstream.features import (
    SplitFeatures,
)
from speechattn.utils import IGNORE_INDEX, lengths_to_padding_mask

log = logging.getLogger(__name__)


@dataclass
class TaskConfig:
    """One downstream task (the `task` group's Hydra schema). The defaults are the default
    task, `speaker_utterance`; the other `conf/task/NAME.yaml` state what differs."""

    name: str = "speaker_utterance"
    target: str = "speaker"  # speaker | phones
    level: str = "utterance"  # utterance (one label per utterance) | frame (one per 10 ms frame)
    pooling: str = "mean"  # utterance level only: mean | fused (FusedAttentionPool)
    pooling_scale: str = "value"  # fused: scores / sqrt(size of V) | key: of Q, K
    hidden_layers: int = 0  # 0 = linear probe
    hidden_dim: int = 768  # the study's phoneme MLP width
    dropout: float = 0.0
    batch_size: int = 8  # utterances (~3k frames at 10 ms): more updates per epoch
    lr: float = 1e-2  # linear on mean-pooled features: few updates per epoch (~54)
    weight_decay: float = 0.0
    # conf/downstream.yaml feeds these to the trainer and early stopping. Utterance-level
    # epochs are cheap (one vector per utterance) and the dev split small and noisy.
    max_epochs: int = 40
    patience: int = 10  # epochs without a better dev accuracy before stopping

    def __post_init__(self) -> None:
        if self.target not in ("speaker", "phones"):
            raise ValueError(
                f"task {self.name}: target must be speaker or phones, not {self.target!r}"
            )
        if self.level not in ("utterance", "frame"):
            raise ValueError(
                f"task {self.name}: level must be utterance or frame, not {self.level!r}"
            )
        if self.level == "utterance" and self.target != "speaker":
            raise ValueError(f"task {self.name}: utterance level needs one label per utterance")


# ----------------------------------------------------------------------------- data


class ProbeDataset(Dataset):
    """Items of one cached split: hidden (N, T', D) plus the task's labels."""

    def __init__(self, split: SplitFeatures, task: TaskConfig) -> None:
        if task.target == "speaker" and split.speakers is None:
            raise ValueError(f"task {task.name}: the corpus provides no speaker labels")
        if task.target == "phones" and split.phones is None:
            raise ValueError(f"task {task.name}: the corpus provides no phone labels")
        self.split, self.task = split, task
        self.hidden = [split.hidden(i) for i in range(len(split))]  # float32 once, not per epoch

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, task = self.split, self.task
        item: dict[str, Any] = {"hidden": self.hidden[i], "utt_id": s.utt_ids[i]}
        if task.target == "phones":
            item["labels"] = s.phones_of(i)  # (T,)
        elif task.level == "frame":  # the utterance's speaker on every 10 ms frame
            item["labels"] = s.speakers[i].repeat(int(s.input_lengths[i]))  # (T,)
        else:
            item["labels"] = s.speakers[i]  # ()
        return item


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad a list of items: hidden (B, N, T', D), lengths (B,), padding_mask (B, T'),
    labels (B,) or (B, T) padded with -100, label_lengths (B,), utt_ids."""
    N, _, D = items[0]["hidden"].shape
    lengths = torch.tensor([it["hidden"].size(1) for it in items])
    hidden = torch.zeros(len(items), N, int(lengths.max()), D)
    for b, it in enumerate(items):
        hidden[b, :, : lengths[b]] = it["hidden"]
    padding_mask = lengths_to_padding_mask(lengths, hidden.size(2))  # (B, T')
    batch: dict[str, Any] = {
        "hidden": hidden,
        "lengths": lengths,
        "padding_mask": padding_mask,
        "utt_ids": [it["utt_id"] for it in items],
    }
    labels = [it["labels"] for it in items]
    if labels[0].dim() == 0:
        batch["labels"] = torch.stack(labels)
    else:
        label_lengths = torch.tensor([len(y) for y in labels])
        padded = torch.full((len(items), int(label_lengths.max())), IGNORE_INDEX, dtype=torch.long)
        for b, y in enumerate(labels):
            padded[b, : len(y)] = y
        batch["labels"], batch["label_lengths"] = padded, label_lengths
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
        super().__init__(
            task.level,
            input_dim,
            num_layers,
            num_classes,
            downsample,
            tolerance,
            pooling=task.pooling,
            pooling_scale=task.pooling_scale,
            hidden_layers=task.hidden_layers,
            hidden_dim=task.hidden_dim,
            dropout=task.dropout,
        )
        self.save_hyperparameters(
            {
                "task": asdict(task),
                "input_dim": input_dim,
                "num_layers": num_layers,
                "num_classes": num_classes,
                "downsample": downsample,
                "tolerance": tolerance,
            }
        )
        self.task = task
        metric = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.train_acc, self.dev_acc, self.test_acc = metric.clone(), metric.clone(), metric.clone()

    def _step(self, batch: dict[str, Any], metric: MulticlassAccuracy) -> Tensor:
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
