"""The downstream task, its probe and `run(cfg)`: evaluate a frozen upstream on one downstream
task (docs/downstream.md); `python -m speechattn.downstream` is its Hydra wrapper. Frame tasks
are scored at the 10 ms label rate (`expand_to_labels`).

Shape letters: B batch, N cached layers, T' upstream frames, T 10 ms label frames, D hidden
dim, C classes.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torchmetrics import Metric

from speechattn import code_version
from speechattn.data import DataConfig, LabelledDataModule
from speechattn.errors import ConfigError
from speechattn.model.probes import Probe
from speechattn.tasks.common import (
    configured_loggers,
    finish_loggers,
    quiet_library_notices,
    run_output_dir,
)
from speechattn.tasks.downstream.features import (
    SPLITS,
    SplitFeatures,
    cached_features,
    check_normalization,
    feature_normalization,
    open_upstream,
    resolve_layers,
    split_loader,
)
from speechattn.tasks.downstream.labels import LabelSource, check_level, label_source
from speechattn.tasks.preemption import AtomicCheckpointIO
from speechattn.tasks.records import EXAMPLE_FILE, MEL, PRETRAIN, DownstreamResult
from speechattn.utils import (
    IGNORE_INDEX,
    atomic_path,
    choose_device,
    lengths_to_padding_mask,
    plain,
)

log = logging.getLogger(__name__)


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


class ProbeDataset(Dataset):
    """Items of one cached split: hidden (N, T', D) plus the task's labels at its level;
    `labels`: the task's label source bound to the corpus (None: unbound)."""

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


# the probe's sizes, as its constructor takes them and its checkpoint's hyper_parameters keep them
PROBE_SIZES = ("input_dim", "num_layers", "num_classes", "downsample", "tolerance")


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
        sizes = dict(zip(PROBE_SIZES, (input_dim, num_layers, num_classes, downsample, tolerance)))
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


@dataclass
class ProbeFit:
    """Outcome of training one probe: accuracies at the best dev checkpoint."""

    dev_accuracy: float
    test_accuracy: float
    best_epoch: int
    epochs_trained: int
    layer_weights: list[float] | None


def fit_probe(
    task: TaskConfig,
    splits: dict[str, SplitFeatures],
    num_classes: int,
    downsample: int,
    tolerance: int,
    trainer_kwargs: dict[str, Any],
    patience: int,
    out: Path,
    labels: LabelSource | None = None,
    loggers: list[Any] | tuple[Any, ...] = (),
) -> ProbeFit:
    """Train on `splits["train"]`, early-stop and checkpoint on dev accuracy, test the best.
    `trainer_kwargs`: conf/trainer/probe.yaml (its `_target_` optional); `loggers`: besides
    `out/logs/metrics.csv`, which is always written."""
    datasets = {name: ProbeDataset(splits[name], task, labels) for name in SPLITS}
    loaders = {
        name: DataLoader(data, task.batch_size, shuffle=name == "train", collate_fn=collate)
        for name, data in datasets.items()
    }
    features = splits["train"].features  # (ΣT', N, D)
    probe = DownstreamProbe(
        task, features.size(-1), features.size(1), num_classes, downsample, tolerance
    )
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        out / "checkpoints", "best-{epoch}", "dev_acc", mode="max", save_weights_only=True
    )
    stopping = L.pytorch.callbacks.EarlyStopping(monitor="dev_acc", mode="max", patience=patience)
    trainer = instantiate(
        {"_target_": "lightning.pytorch.Trainer", **plain(trainer_kwargs)},
        callbacks=[checkpoint, stopping],
        logger=[L.pytorch.loggers.CSVLogger(out, name="logs", version=""), *loggers],
        default_root_dir=str(out),
        # written beside the target, not staged in $TMPDIR; a full disk names the file
        plugins=[AtomicCheckpointIO()],
        _convert_="all",
    )
    trainer.fit(probe, loaders["train"], loaders["dev"])
    best = checkpoint.best_model_path
    if not best:
        raise ConfigError(
            f"task {task.name}: no dev evaluation ran, so there is no best checkpoint "
            f"(trainer.max_epochs={trainer.max_epochs}: train at least one epoch)"
        )
    epochs = int(trainer.current_epoch)
    # trainer.test loads the best checkpoint's weights into `probe`
    tested = trainer.test(probe, loaders["test"], ckpt_path=best, verbose=False, weights_only=True)
    return ProbeFit(
        dev_accuracy=float(checkpoint.best_model_score),
        test_accuracy=float(tested[0]["test_acc"]),
        best_epoch=int(re.search(r"epoch=(\d+)", Path(best).name).group(1)),
        epochs_trained=epochs,
        layer_weights=probe.select.weights().tolist() if probe.select.num_layers > 1 else None,
    )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate `cfg.upstream` on `cfg.task`; writes `result.json` and returns it as a dict."""
    t_start = time.perf_counter()
    quiet_library_notices()
    task = TaskConfig(**plain(cfg.task))
    if task.name == PRETRAIN:
        raise ConfigError("task=pretrain is the head analysis' objective, not a downstream task")
    out = run_output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        cfg.output_dir = str(out)  # where conf/logger/ writes (`${output_dir}`)
    L.seed_everything(cfg.seed, workers=True)
    data_config = labelled_data_config(task, DataConfig(**plain(cfg.data)))
    # the upstream first: a wrong upstream= or feature setting fails before any extraction
    upstream, sha = open_upstream(cfg.upstream, data_config.feature_dim, data_config)
    layers = resolve_layers(cfg.layer, upstream.num_layers)
    check_normalization(data_config.normalization, upstream, cfg.normalization)
    datamodule = LabelledDataModule(data_config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    labels = task.labels(datamodule)
    num_classes = labels.check_classes(task.name)
    check_input_frames(upstream, datamodule)
    normalization = feature_normalization(datamodule.normalizer, upstream, cfg.normalization)
    t_features = time.perf_counter()
    splits = cached_features(
        upstream,
        sha or f"{MEL}:{datamodule.feature_dim}",
        layers,
        datamodule,
        plain(data_config),
        cfg.get("cache_dir") or data_config.cache_root() / "downstream",
        choose_device(cfg.get("device", "auto")),
        data_config.progress,
        normalization,
    )
    upstream.cpu()
    runtime = {"features": time.perf_counter() - t_features}
    for name in SPLITS:
        labels.check_lengths(splits[name], upstream.downsample, cfg.tolerance)
    t_train = time.perf_counter()
    loggers = configured_loggers(cfg)
    try:
        fit = fit_probe(
            task,
            splits,
            num_classes=num_classes,
            downsample=upstream.downsample,
            tolerance=cfg.tolerance,
            trainer_kwargs=plain(cfg.trainer),
            patience=cfg.early_stopping.patience,
            out=out,
            labels=labels,
            loggers=loggers,
        )
    finally:
        finish_loggers(loggers)
    runtime.update(train=time.perf_counter() - t_train, total=time.perf_counter() - t_start)
    meta = dict(getattr(upstream, "metadata", {}) or {})
    config = getattr(upstream, "config", None)  # None for mel
    steps = [meta[k] for k in ("global_step", "steps", "step", "pretraining_steps") if k in meta]
    result = DownstreamResult(
        task=task.name,
        upstream=upstream_name(cfg.upstream),
        upstream_sha256=sha,
        attention=upstream.attention_name,
        attention_config={}
        if config is None
        else {"name": config.attention, "options": plain(dict(config.attention_options))},
        model_config={} if config is None else plain(config),
        pretraining_steps=next((int(s) for s in steps if isinstance(s, int)), None),
        upstream_parameters=int(
            meta.get("num_params") or sum(p.numel() for p in upstream.parameters())
        ),
        layer=cfg.layer,
        pooling=task.pooling if task.level == "utterance" else None,
        probe={
            **asdict(task),
            "max_epochs": int(cfg.trainer.max_epochs),  # what ran, after overrides
            "patience": int(cfg.early_stopping.patience),
            "layers": layers,
            "layer_weights": fit.layer_weights,
        },
        # the normalisation: what the upstream saw, and why
        corpus={
            **plain(datamodule.describe()),
            "config": plain(data_config),
            "normalization": normalization.record,
        },
        split_sizes={name: len(splits[name]) for name in SPLITS},
        eval_frames={name: labels.scored(splits[name], task.level) for name in ("dev", "test")},
        frames_per_utterance=round(float(splits["test"].lengths.float().mean()), 2),
        num_classes=int(num_classes),
        dev_accuracy=fit.dev_accuracy,
        test_accuracy=fit.test_accuracy,
        best_epoch=fit.best_epoch,
        epochs_trained=fit.epochs_trained,
        seed=int(cfg.seed),
        code_version=code_version(),
        runtime_s={k: round(v, 2) for k, v in runtime.items()},
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    path = result.write(out)
    _save_example(datamodule, out)
    log.info(
        "%s on %s: dev %.4f test %.4f -> %s",
        task.name,
        result.attention,
        result.dev_accuracy,
        result.test_accuracy,
        path,
    )
    return result.to_dict()


def upstream_name(spec: Any) -> str:
    """What a record names the upstream by: `mel`, or the upstream file's absolute path."""
    return str(spec) if str(spec) == MEL else str(Path(spec).resolve())


def labelled_data_config(task: TaskConfig, data_config: Any) -> Any:
    """The data config for `task`; where the phone-alignments file is unset or absent, phone
    tasks fail naming the file and the others run without phone labels (`alignments=None`)."""
    path = None
    if data_config.alignments is not None:
        path = LabelledDataModule(data_config).corpus.missing_labels()
        if path is None:
            return data_config
    task.labels().missing_alignments(task.name, data_config.alignments, path)
    if data_config.alignments is None:
        return data_config
    log.warning("no phone alignments at %s: %s runs without phone labels", path, task.name)
    return replace(data_config, alignments=None)


def check_input_frames(upstream: Any, datamodule: Any) -> None:
    """Fail before extraction when the corpus's (cropped) utterances exceed the upstream's
    attention limit (synthesizers: max_len model frames)."""
    model = getattr(upstream, "model", None)
    if not hasattr(model, "check_input_frames"):
        return  # mel, or an upstream without a length limit
    crop = datamodule.cfg.labelled_max_frames
    if crop is None:  # uncropped: the longest utterance decides
        lengths = [int(ds.lengths.max()) for ds in datamodule.datasets.values() if len(ds.lengths)]
        model.check_input_frames(max(lengths, default=0), "data.labelled_max_frames", True)
    else:
        model.check_input_frames(crop, "data.labelled_max_frames")


def _save_example(datamodule: Any, out: Path) -> None:
    """Keep one normalised test utterance beside the result, for the report's attention maps."""
    try:
        batch = next(iter(split_loader(datamodule, "test")))
    except (StopIteration, AttributeError):
        return
    n = int(batch["lengths"][0])
    example = {
        "utt_id": batch["utt_ids"][0],
        "features": batch["features"][0, :n].clone(),  # (T, F) normalised log-mel
        "speaker": int(batch["speaker"][0]) if batch.get("speaker") is not None else None,
    }
    with atomic_path(out / EXAMPLE_FILE) as tmp:
        torch.save(example, tmp)
