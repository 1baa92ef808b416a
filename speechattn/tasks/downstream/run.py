"""`run(cfg)`: evaluate a frozen upstream on one downstream task (docs/downstream.md).

Build the labelled corpus and open the upstream, extract the chosen layers once per split into
the feature cache (`features.py`), train the task's probe (early stopping and checkpoints on dev
accuracy), score test with the best-dev checkpoint and write `result.json` (`tasks/records.py`).
`python -m speechattn.downstream` is its Hydra wrapper. Frame tasks are scored at the 10 ms
label rate: logits per upstream frame are repeated `downsample` times and trimmed/padded to the
label length (`expand_to_labels`), which equals repeating the features.
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
from torch.utils.data import DataLoader

from speechattn.data import DataConfig, LabelledDataModule
from speechattn.errors import ConfigError
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
from speechattn.tasks.downstream.labels import LabelSource
from speechattn.tasks.downstream.probe import DownstreamProbe, ProbeDataset, TaskConfig, collate
from speechattn.tasks.preemption import AtomicCheckpointIO
from speechattn.tasks.records import EXAMPLE_FILE, MEL, PRETRAIN, DownstreamResult
from speechattn.utils import atomic_path, choose_device, plain

log = logging.getLogger(__name__)


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

    `trainer_kwargs`: the Trainer's arguments (`conf/trainer/probe.yaml`, its `_target_`
    optional); `labels`: the task's label source bound to the corpus (None: unbound);
    `loggers`: besides `out/logs/metrics.csv`, which is always written.
    """
    loaders = {
        name: DataLoader(
            ProbeDataset(splits[name], task, labels),
            batch_size=task.batch_size,
            shuffle=name == "train",
            collate_fn=collate,
            num_workers=0,
        )
        for name in SPLITS
    }
    features = splits["train"].features  # (ΣT', N, D)
    probe = DownstreamProbe(
        task, features.size(-1), features.size(1), num_classes, downsample, tolerance
    )
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / "checkpoints",
        monitor="dev_acc",
        mode="max",
        save_top_k=1,
        save_weights_only=True,
        filename="best-{epoch}",
    )
    stopping = L.pytorch.callbacks.EarlyStopping(monitor="dev_acc", mode="max", patience=patience)
    # the Trainer of conf/trainer/probe.yaml (`_target_` defaults to Lightning's); per-epoch
    # metrics always go to out/logs/metrics.csv, whatever the logger
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
    # trainer.test loads the best checkpoint's weights into `probe`.
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
    runtime["train"] = time.perf_counter() - t_train
    runtime["total"] = time.perf_counter() - t_start
    from speechattn import code_version  # the package root, imported lazily (no cycle)

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
    """The data config for `task`, failing early (naming the file) when labels are missing.

    Where the phone-alignments file is unset or absent, the task's label source decides: phone
    tasks refuse to run; the others run without phone labels (`alignments=None`).
    """
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
