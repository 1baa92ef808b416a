"""Downstream evaluation of a frozen upstream (docs/downstream.md): probe training, model selection, result.

`run(cfg)` is the whole protocol; `python -m speechattn.downstream` is a thin Hydra wrapper:

1. build the labelled corpus (`LabelledDataModule`) and open the upstream (`upstream.pt` or `mel`),
2. extract the chosen layer(s) once per split into the feature cache (`features.py`),
3. train the task's probe on train with Lightning, early-stop and checkpoint on dev accuracy,
4. score test with the best-dev checkpoint and write `result.json` (`tasks/records.py`).

Tasks (`TaskConfig`; conf/task/NAME.yaml states how each differs from speaker_utterance):

    speaker_utterance  mean (or fused attention) pooling + linear, one speaker per utterance
    speaker_frame      linear per frame, the utterance's speaker on every frame
    phone_1hidden      MLP, one hidden ReLU layer (768), per frame
    phone_2hidden      MLP, two hidden ReLU layers (768), per frame

Frame tasks are scored at the 10 ms label rate over all valid frames: the probe runs once per
upstream frame and its logits are repeated `downsample` times and trimmed/padded to the label
length (`speechattn.data.features.expand_to_labels`), which equals repeating the features.

Shape letters: B batch, N cached layers, T' upstream frames, T 10 ms label frames, D hidden
dim, C classes.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.utils.data import DataLoader

from speechattn.data import DataConfig, LabelledDataModule, expand_to_labels
from speechattn.tasks.common import quiet_library_notices, run_output_dir
from speechattn.tasks.downstream.features import (
    SPLITS,
    DamagedSplit,
    SplitFeatures,
    cache_key,
    extract_split,
    load_split,
    open_upstream,
    resolve_layers,
    save_split,
    tensor_digest,
)
from speechattn.tasks.downstream.probe import DownstreamProbe, ProbeDataset, TaskConfig, collate
from speechattn.tasks.records import EXAMPLE_FILE, MEL, PRETRAIN, TASKS, DownstreamResult
from speechattn.utils import atomic_path, choose_device

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- features


def cached_features(
    upstream: torch.nn.Module,
    upstream_id: str,
    layers: list[int],
    datamodule: Any,
    data_config: dict[str, Any],
    cache_dir: str | Path,
    device: torch.device | str = "cpu",
    progress_bar: bool = True,
) -> dict[str, SplitFeatures]:
    """Hidden states `layers` of every split, from the cache or extracted (then cached) once."""
    normalizer = getattr(datamodule, "normalizer", None)
    stats = tensor_digest(getattr(normalizer, "mean", None), getattr(normalizer, "std", None))
    key = cache_key(upstream_id, layers, data_config, stats)
    folder = Path(cache_dir).expanduser() / key
    splits: dict[str, SplitFeatures] = {}
    upstream = upstream.to(device)
    for name in SPLITS:
        path = folder / f"{name}.pt"
        if path.is_file():
            try:
                splits[name] = load_split(path)
                log.info("features %s: cached %s", name, path)
                continue
            except DamagedSplit as e:
                log.warning("%s; extracting it again", e)
        loader = _split_loader(datamodule, name)
        total = len(loader) if hasattr(loader, "__len__") else None
        splits[name] = extract_split(
            upstream,
            loader,
            layers,
            total=total,
            description=f"features {name}",
            device=device,
            transform=renormalizer(normalizer, upstream),
            progress_bar=progress_bar,
        )
        save_split(splits[name], path)
        log.info("features %s: %d utterances -> %s", name, len(splits[name]), path)
    return splits


def renormalizer(normalizer: Any, upstream: torch.nn.Module) -> Any:
    """Map features normalised with the corpus statistics onto the upstream's own statistics.

    The data module normalises with its training split's mean/std; an upstream pretrained on
    another corpus (train-clean-360 vs train-clean-100) saw its own. Returns
    `f(features (B, T, F), padding_mask (B, T)) -> features`, or None when nothing to do.
    """
    src_mean, src_std = getattr(normalizer, "mean", None), getattr(normalizer, "std", None)
    dst_mean, dst_std = getattr(upstream, "mean", None), getattr(upstream, "std", None)
    modes = {getattr(normalizer, "mode", "global")}
    modes.add(getattr(getattr(upstream, "normalizer", None), "mode", "global"))
    if modes != {"global"} or src_mean is None or dst_mean is None:
        return None
    if torch.allclose(src_mean, dst_mean.cpu(), atol=1e-4) and torch.allclose(
        src_std, dst_std.cpu(), atol=1e-4
    ):
        return None
    log.info("features: mapping corpus normalisation onto the upstream's pretraining statistics")

    def remap(features: Tensor, padding_mask: Tensor) -> Tensor:
        d = features.device
        raw = features * src_std.to(d) + src_mean.to(d)  # (B, T, F) log-mel
        out = (raw - dst_mean.to(d)) / dst_std.to(d)
        return out.masked_fill(padding_mask.unsqueeze(-1), 0.0)

    return remap


def _split_loader(datamodule: Any, split: str) -> Any:
    if hasattr(datamodule, "extraction_dataloader"):
        return datamodule.extraction_dataloader(split)
    return {
        "train": datamodule.train_dataloader,
        "dev": datamodule.val_dataloader,
        "test": datamodule.test_dataloader,
    }[split]()


def check_label_lengths(split: SplitFeatures, downsample: int, tolerance: int) -> None:
    """Raise (naming the utterance) when phone labels and features disagree beyond `tolerance`.

    Runs `expand_to_labels` on zero-width stand-ins, so every utterance is checked before any
    training starts.
    """
    if split.phone_lengths is None:
        return
    for start in range(0, len(split), 256):
        stop = min(start + 256, len(split))
        lengths = split.lengths[start:stop]
        dummy = torch.zeros(stop - start, int(lengths.max()), 1)  # (B, T', 1)
        expand_to_labels(
            dummy,
            downsample,
            split.phone_lengths[start:stop],
            split.utt_ids[start:stop],
            tolerance,
            lengths=lengths,
        )


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
) -> ProbeFit:
    """Train on `splits["train"]`, early-stop and checkpoint on dev accuracy, test the best."""
    loaders = {
        name: DataLoader(
            ProbeDataset(splits[name], task),
            batch_size=task.batch_size,
            shuffle=name == "train",
            collate_fn=collate,
            num_workers=0,
        )
        for name in SPLITS
    }
    probe = DownstreamProbe(
        task,
        input_dim=splits["train"].features.size(-1),
        num_layers=splits["train"].features.size(1),
        num_classes=num_classes,
        downsample=downsample,
        tolerance=tolerance,
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
    trainer = L.Trainer(
        **trainer_kwargs,
        callbacks=[checkpoint, stopping],
        logger=L.pytorch.loggers.CSVLogger(out, name="logs", version=""),
        default_root_dir=out,
    )
    trainer.fit(probe, loaders["train"], loaders["dev"])
    best = checkpoint.best_model_path
    if not best:
        raise RuntimeError(
            f"task {task.name}: no dev evaluation ran, so there is no best checkpoint"
        )
    dev_accuracy = float(checkpoint.best_model_score)
    epochs = int(trainer.current_epoch)
    # trainer.test loads the best checkpoint's weights into `probe`.
    test_metrics = trainer.test(
        probe, loaders["test"], ckpt_path=best, verbose=False, weights_only=True
    )
    weights = probe.select.weights().tolist() if probe.select.num_layers > 1 else None
    return ProbeFit(
        dev_accuracy=dev_accuracy,
        test_accuracy=float(test_metrics[0]["test_acc"]),
        best_epoch=int(re.search(r"epoch=(\d+)", Path(best).name).group(1)),
        epochs_trained=epochs,
        layer_weights=weights,
    )


# ----------------------------------------------------------------------------- run


def _plain(value: Any) -> Any:
    """Dataclasses / DictConfigs / tensors -> JSON-friendly values."""
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if isinstance(value, DictConfig):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return value


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate `cfg.upstream` on `cfg.task`; writes `result.json` and returns it as a dict."""
    t_start = time.perf_counter()
    quiet_library_notices()
    task = TaskConfig(**OmegaConf.to_container(cfg.task, resolve=True))
    if task.name == PRETRAIN:
        raise ValueError("task=pretrain is the head analysis' objective, not a downstream task")
    if task.name not in TASKS:
        log.warning("task %s is not one of the study's tasks %s", task.name, TASKS)
    out = run_output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)

    data_config = labelled_data_config(
        task, DataConfig(**OmegaConf.to_container(cfg.data, resolve=True))
    )
    datamodule = LabelledDataModule(data_config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    _require_labels(task, datamodule)

    upstream, sha = open_upstream(cfg.upstream, datamodule.feature_dim)
    _check_input_frames(upstream, datamodule)
    layers = resolve_layers(cfg.layer, upstream.num_layers)
    device = choose_device(cfg.get("device", "auto"))
    t_features = time.perf_counter()
    cache_dir = cfg.get("cache_dir") or data_config.cache_root() / "downstream"
    splits = cached_features(
        upstream,
        sha or f"{MEL}:{datamodule.feature_dim}",
        layers,
        datamodule,
        _plain(data_config),
        cache_dir,
        device,
        progress_bar=data_config.progress,
    )
    upstream.cpu()
    t_features = time.perf_counter() - t_features
    if task.target == "phones":
        for name in SPLITS:
            check_label_lengths(splits[name], upstream.downsample, cfg.tolerance)
    num_classes = datamodule.num_speakers if task.target == "speaker" else datamodule.num_phones

    t_train = time.perf_counter()
    fit = fit_probe(
        task,
        splits,
        num_classes=num_classes,
        downsample=upstream.downsample,
        tolerance=cfg.tolerance,
        trainer_kwargs=OmegaConf.to_container(cfg.trainer, resolve=True),
        patience=cfg.early_stopping.patience,
        out=out,
    )
    t_train = time.perf_counter() - t_train
    meta = dict(getattr(upstream, "metadata", {}) or {})
    result = DownstreamResult(
        task=task.name,
        upstream=str(cfg.upstream)
        if str(cfg.upstream) == MEL
        else str(Path(cfg.upstream).resolve()),
        upstream_sha256=sha,
        attention=upstream.attention_name,
        attention_config=_attention_config(upstream),
        model_config=_model_config(upstream),
        pretraining_steps=_pretraining_steps(meta),
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
        corpus={**_plain(datamodule.describe()), "config": _plain(data_config)},
        split_sizes={name: len(splits[name]) for name in SPLITS},
        eval_frames={name: _eval_count(splits[name], task) for name in ("dev", "test")},
        frames_per_utterance=round(float(splits["test"].lengths.float().mean()), 2),
        num_classes=int(num_classes),
        dev_accuracy=fit.dev_accuracy,
        test_accuracy=fit.test_accuracy,
        best_epoch=fit.best_epoch,
        epochs_trained=fit.epochs_trained,
        seed=int(cfg.seed),
        code_version=_code_version(),
        runtime_s={
            "features": round(t_features, 2),
            "train": round(t_train, 2),
            "total": round(time.perf_counter() - t_start, 2),
        },
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    path = result.write(out)
    _save_example(splits, datamodule, out)
    log.info(
        "%s on %s: dev %.4f test %.4f -> %s",
        task.name,
        result.attention,
        result.dev_accuracy,
        result.test_accuracy,
        path,
    )
    return result.to_dict()


def labelled_data_config(task: TaskConfig, data_config: Any) -> Any:
    """The data config for `task`, failing early (naming the file) when labels are missing.

    Phone tasks need the frame-level alignments file; speaker tasks only need the audio, so
    for them a missing alignments file is dropped (`alignments=None`) rather than an error.
    """
    if data_config.alignments is None:
        if task.target == "phones":
            raise ValueError(
                f"task {task.name} needs frame-level phone labels, but data.alignments is null; "
                f"set it to the CPC-format file (converted_aligned_phones.txt, docs/data.md)"
            )
        return data_config
    path = LabelledDataModule(data_config).label_files.path(data_config.alignments)
    if path is not None and path.is_file():
        return data_config
    if task.target == "phones":
        raise FileNotFoundError(
            f"task {task.name} needs frame-level phone labels: {path} does not exist. For real "
            f"LibriSpeech put the CPC alignments there (converted_aligned_phones.txt with "
            f"train_split.txt / test_split.txt, see docs/data.md) or point data.alignments_dir at them"
        )
    log.warning("no phone alignments at %s: speaker task without phone labels", path)
    return replace(data_config, alignments=None)


def _check_input_frames(upstream: Any, datamodule: Any) -> None:
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


def _require_labels(task: TaskConfig, datamodule: Any) -> None:
    """The labels really arrived (e.g. an alignments file without a single usable line)."""
    if task.target == "phones" and not datamodule.num_phones:
        raise ValueError(
            f"task {task.name}: the corpus yielded no phone classes from "
            f"{datamodule.label_files.path(datamodule.cfg.alignments)}"
        )
    if task.target == "speaker" and datamodule.num_speakers < 2:
        raise ValueError(
            f"task {task.name} needs at least 2 speakers, the corpus has {datamodule.num_speakers}"
        )


def _model_config(upstream: Any) -> dict[str, Any]:
    config = getattr(upstream, "config", None)
    return _plain(config) if config is not None else {}


def _attention_config(upstream: Any) -> dict[str, Any]:
    config = getattr(upstream, "config", None)
    if config is None:
        return {}
    return {"name": config.attention, "options": _plain(dict(config.attention_options))}


def _pretraining_steps(meta: dict[str, Any]) -> int | None:
    for key in ("global_step", "steps", "step", "pretraining_steps"):
        if isinstance(meta.get(key), int):
            return int(meta[key])
    return None


def _eval_count(split: SplitFeatures, task: TaskConfig) -> int:
    """Utterances (utterance tasks) or 10 ms frames (frame tasks) that accuracy is taken over."""
    if task.level == "utterance":
        return len(split)
    if task.target == "phones" and split.phone_lengths is not None:
        return int(split.phone_lengths.sum())
    return int(split.input_lengths.sum())


def _code_version() -> str:
    from speechattn import code_version  # the package root, imported lazily (no cycle)

    return code_version()


def _save_example(splits: dict[str, SplitFeatures], datamodule: Any, out: Path) -> None:
    """Keep one normalised test utterance beside the result, for the report's attention maps."""
    try:
        batch = next(iter(_split_loader(datamodule, "test")))
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
