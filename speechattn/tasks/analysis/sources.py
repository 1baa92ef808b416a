"""The head analysis job: where it gets its model, probe and data (docs/analysis.md), and how
its `heads.json` is assembled; `run(cfg)` is `python -m speechattn.analyze heads`. A missing or
mismatched input is an error naming the file and what is expected."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from speechattn import CONFIG_DIR, code_version
from speechattn.data import build_datamodule
from speechattn.errors import ConfigError, MissingFileError
from speechattn.model.masking import MaskingConfig
from speechattn.model.serialization import TorchFileError, describe_load_error, load_torch_file
from speechattn.tasks.analysis.heads import (
    HeadAnalysis,
    HeadsConfig,
    NonFiniteMetricError,
    Objective,
    PretrainObjective,
    ProbeObjective,
    analyze_heads,
)
from speechattn.tasks.common import quiet_library_notices, run_output_dir
from speechattn.tasks.downstream.features import feature_normalization, open_upstream, split_loader
from speechattn.tasks.records import (
    HEADS_SCHEMA_VERSION,
    KIND,
    MEL,
    PRETRAIN,
    RESULT_FILE,
    TASKS,
    HeadsRecord,
    read_result,
    write_heads,
)
from speechattn.utils import choose_device, lengths_to_padding_mask

log = logging.getLogger(__name__)
SPLIT_CHOICES = ("dev", "test")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class HeadsRunConfig(HeadsConfig):
    """`python -m speechattn.analyze heads`: the analyses (`importance`, `ablation`,
    `pruning`, from `HeadsConfig`) and where they run (the schema of `conf/analyze.yaml`)."""

    analysis: str = "heads"  # the `analysis` group's option (the only analysis so far)
    upstream: str | None = None  # upstream.pt; for downstream tasks default: result.json's
    # pretrain | a downstream task (a name, or the `task` group's node); None: pretrain, or the
    # downstream run's task
    task: Any = None
    downstream: str | None = None  # run dir of `python -m speechattn.downstream`
    split: str = "dev"  # downstream subset: dev | test (pretrain always uses its validation split)
    num_batches: int | None = 8  # batches in the subset; None: the whole split
    batch_size: int | None = None  # None: the data config's
    seed: int = 0  # fixed reconstruction masks (task=pretrain): the same in every evaluation
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | float64
    data: Any = None  # a data config; None: the one recorded with the upstream/probe
    progress: bool = True  # rich progress bars
    figures: bool = True  # write the PNGs next to heads.json
    output_dir: str | None = None  # None: the Hydra run dir

    def __post_init__(self) -> None:
        if isinstance(self.task, dict) or hasattr(self.task, "name"):  # the task group's node
            self.task = self.task["name"] if isinstance(self.task, dict) else self.task.name
        if is_dataclass(self.data):
            self.data = asdict(self.data)
        if self.analysis != "heads":
            raise ConfigError(f"unknown analysis {self.analysis!r}; choose heads")
        if self.task is not None and self.task not in head_tasks():
            raise ConfigError(
                f"unknown task {self.task!r}; choose one of {', '.join(head_tasks())}"
            )
        if self.split not in SPLIT_CHOICES:
            raise ConfigError(f"split must be one of {SPLIT_CHOICES}, got {self.split!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.num_batches is not None and self.num_batches < 1:
            raise ConfigError(f"num_batches must be >= 1 or null, got {self.num_batches}")

    @property
    def heads(self) -> HeadsConfig:
        """The analyses alone (what `analyze_heads` and heads.json's config record)."""
        return HeadsConfig(self.importance, self.ablation, self.pruning)


def head_tasks() -> list[str]:
    """What `task=` may name: pretrain, the study's tasks, then the other options of the `task`
    group (conf/task/)."""
    others = {p.stem for p in (CONFIG_DIR / "task").glob("*.yaml")} - {PRETRAIN, *TASKS}
    return [PRETRAIN, *TASKS, *sorted(others)]


def analysed_upstream(spec: str | Path | None) -> tuple[nn.Module, str, Path]:
    """(upstream, sha256, resolved path) of an `upstream.pt`, opened as downstream opens it;
    refuses `mel` and upstreams without attention heads."""
    if spec in (None, ""):
        raise ConfigError(
            "upstream=PATH is required: an upstream.pt written by `python -m speechattn.pretrain`"
        )
    if str(spec) == MEL:
        raise ConfigError("upstream=mel has no attention heads to analyse; pass an upstream.pt")
    path = Path(spec).expanduser().resolve()
    upstream, sha = open_upstream(path)
    if not int(getattr(upstream, "num_heads", 0)):
        raise ConfigError(f"{path}: the upstream has no attention heads")
    return upstream, sha, path


@dataclass
class ProbeRun:
    directory: Path
    result: Any  # DownstreamResult
    checkpoint: Path
    probe: nn.Module  # DownstreamProbe with the best-dev weights
    layers: list[int]


def load_probe_run(directory: str | Path) -> ProbeRun:
    """Read `result.json` and rebuild the best probe of a downstream run directory."""
    from speechattn.tasks.downstream import DownstreamProbe, TaskConfig
    from speechattn.tasks.downstream.run import PROBE_SIZES

    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise MissingFileError(
            f"downstream={directory} is not a directory; pass the run dir of "
            f"`python -m speechattn.downstream` (it holds {RESULT_FILE} and checkpoints/)"
        )
    result_path = directory / RESULT_FILE
    if not result_path.is_file():
        raise MissingFileError(
            f"downstream run {directory} has no {RESULT_FILE}: the run did not finish, or this "
            f"is not a `python -m speechattn.downstream` run dir"
        )
    result = read_result(result_path)
    if result.upstream == MEL:
        raise ConfigError(
            f"{result_path}: that probe was trained on upstream=mel, which has no attention heads"
        )
    folder = directory / "checkpoints"
    candidates = sorted(folder.glob("best-*.ckpt"))
    if not candidates:
        raise MissingFileError(
            f"downstream run {directory} has no probe checkpoint: expected "
            f"{folder}/best-epoch=N.ckpt (written by `python -m speechattn.downstream`)"
        )
    checkpoint = folder / f"best-epoch={result.best_epoch}.ckpt"  # else the newest
    if checkpoint not in candidates:
        checkpoint = max(candidates, key=lambda p: p.stat().st_mtime)
    try:
        state = load_torch_file(checkpoint, "cpu")
        hp = state["hyper_parameters"]
        task = TaskConfig(**hp["task"])
        probe = DownstreamProbe(task, *(int(hp[k]) for k in PROBE_SIZES))
        probe.load_state_dict(state["state_dict"])
    except Exception as e:
        detail = (
            describe_load_error(e.__cause__ or e, checkpoint)
            if isinstance(e, TorchFileError)
            else f"{type(e).__name__}: {e}"
        )
        raise TorchFileError(
            f"{checkpoint}: not a readable downstream probe checkpoint: {detail}"
        ) from e
    layers = [int(i) for i in (result.probe or {}).get("layers", [])]
    if len(layers) != probe.select.num_layers:
        raise ConfigError(
            f"{result_path}: probe.layers {layers} does not match the checkpoint's "
            f"{probe.select.num_layers} input layer(s)"
        )
    if task.name != result.task:
        raise ConfigError(
            f"{checkpoint} is a {task.name} probe but {result_path} says {result.task}"
        )
    return ProbeRun(directory, result, checkpoint, probe.eval(), layers)


def subset_batches(
    loader: Any, num_batches: int | None, datamodule: Any, upstream: nn.Module
) -> list[dict[str, Any]]:
    """The first `num_batches` batches of a deterministic loader (all with None), normalised as
    downstream feature extraction does."""
    batches = list(itertools.islice(iter(loader), num_batches))
    if not batches:
        raise ConfigError("the data split is empty: no batches to analyse")
    normalizer = getattr(datamodule, "normalizer", None)
    transform = (
        None if normalizer is None else feature_normalization(normalizer, upstream).transform
    )
    if transform is None:
        return batches
    out = []
    for b in batches:
        mask = b.get("padding_mask")
        if mask is None:
            mask = lengths_to_padding_mask(b["lengths"], b["features"].shape[1])
        out.append({**b, "features": transform(b["features"], mask)})
    return out


def recorded_data_config(corpus: dict[str, Any] | None) -> dict[str, Any]:
    """The data config a downstream run recorded in result.json: `corpus["config"]`, or
    `corpus` itself when it is the bare data config."""
    corpus = dict(corpus or {})
    config = corpus.get("config")
    return dict(config) if isinstance(config, dict) else corpus


def _datamodule(datamodule: Any, data: dict[str, Any], batch_size: int | None, kind: str) -> Any:
    """`datamodule` (tests pass synthetic data), or the one `data` describes, set up to fit."""
    if datamodule is None:
        data = data if batch_size is None else {**data, "batch_size": int(batch_size)}
        datamodule = build_datamodule(data, kind)
        datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


@dataclass
class Prepared:
    objective: Objective
    task: str
    upstream: nn.Module
    upstream_path: Path
    upstream_sha256: str
    split: str
    downstream: dict[str, Any] | None


def prepare_pretrain(config: HeadsRunConfig, datamodule: Any = None) -> Prepared:
    """task=pretrain: the upstream's reconstruction loss on its pretraining validation split
    (`datamodule`: instead of the one the recorded data config builds)."""
    if config.task not in (None, PRETRAIN):
        raise ConfigError(
            f"task={config.task} needs downstream=RESULT_DIR: the run dir of "
            f"`python -m speechattn.downstream task={config.task} upstream=...` (it holds "
            f"{RESULT_FILE} and checkpoints/best-epoch=N.ckpt with the trained probe)"
        )
    upstream, sha, path = analysed_upstream(config.upstream)
    data = config.data or dict(upstream.metadata.get("data_config") or {})
    if datamodule is None and not data:
        raise ConfigError(
            f"{path} does not record its pretraining data (metadata.data_config); "
            f"choose it with data=embedded or data=librispeech data.root=DIR"
        )
    datamodule = _datamodule(datamodule, data, config.batch_size, "pretrain")
    if config.split != "dev":
        log.info("task=pretrain: the subset is the pretraining validation split")
    batches = subset_batches(datamodule.val_dataloader(), config.num_batches, datamodule, upstream)
    masking = MaskingConfig(**(upstream.metadata.get("masking") or {}))
    device, dtype = choose_device(config.device), DTYPES[config.dtype]
    objective = PretrainObjective(upstream.model, batches, masking, config.seed, device, dtype)
    return Prepared(objective, PRETRAIN, upstream, path, sha, "val", None)


def prepare_probe(config: HeadsRunConfig, datamodule: Any = None) -> Prepared:
    """A downstream task: the trained probe's accuracy on the dev (or test) split of the
    downstream run's corpus."""
    run = load_probe_run(config.downstream)
    result_path = run.directory / RESULT_FILE
    if config.task not in (None, run.result.task):
        raise ConfigError(
            f"task={config.task} but downstream={run.directory} is a {run.result.task} run "
            f"({result_path})"
        )
    upstream, sha, path = analysed_upstream(config.upstream or run.result.upstream)
    if run.result.upstream_sha256 and run.result.upstream_sha256 != sha:
        raise ConfigError(
            f"{path} is not the upstream the probe in {run.directory} was trained on "
            f"(sha256 {sha[:12]}..., {RESULT_FILE} records {run.result.upstream_sha256[:12]}... "
            f"for {run.result.upstream})"
        )
    hp = run.probe.hparams
    if hp["input_dim"] != upstream.hidden_dim:
        raise ConfigError(
            f"{run.checkpoint}: the probe reads {hp['input_dim']}-dim features, "
            f"the upstream {path} gives {upstream.hidden_dim}"
        )
    data = config.data or recorded_data_config(run.result.corpus)
    if datamodule is None and not data:
        raise ConfigError(f"{result_path} records no corpus; pass data=...")
    datamodule = _datamodule(datamodule, data, config.batch_size, "labelled")
    datamodule.setup("test")
    task = run.probe.task
    labels = task.labels(datamodule)
    found = labels.num_classes()
    if found is not None and int(found) != int(hp["num_classes"]):
        raise ConfigError(
            f"the corpus has {found} {task.target} classes but the probe in {run.directory} was "
            f"trained on {hp['num_classes']}: use the downstream run's corpus (leave data unset)"
        )
    loader = split_loader(datamodule, config.split)
    batches = subset_batches(loader, config.num_batches, datamodule, upstream)
    device, dtype = choose_device(config.device), DTYPES[config.dtype]
    objective = ProbeObjective(
        upstream, run.probe, run.layers, batches, labels, task.level, device, dtype
    )
    downstream = {
        "dir": str(run.directory),
        "checkpoint": str(run.checkpoint),
        "layers": run.layers,
        "dev_accuracy": run.result.dev_accuracy,
        "test_accuracy": run.result.test_accuracy,
    }
    return Prepared(objective, run.result.task, upstream, path, sha, config.split, downstream)


def result_dict(
    analysis: HeadAnalysis, prepared: Prepared, config: HeadsRunConfig, runtime_s: dict[str, float]
) -> HeadsRecord:
    """The `heads.json` object (schema in `speechattn.tasks.records`)."""
    up = prepared.upstream
    model_config = up.config.to_dict() if hasattr(up, "config") else {}
    imp, ab, pruning = analysis.importance, analysis.ablation, None
    if analysis.pruning:
        pruning = {k: v for k, v in asdict(config.heads.pruning).items() if k != "enabled"}
        pruning["points"] = [
            {
                **vars(pt),
                "newly_masked": [list(x) for x in pt.newly_masked],
                "mask": pt.mask.int().tolist(),
            }
            for pt in analysis.pruning
        ]
    return {
        "schema_version": HEADS_SCHEMA_VERSION,
        "kind": KIND,
        "task": prepared.task,
        "metric": analysis.metric_name,
        "higher_is_better": analysis.higher_is_better,
        "base_metric": analysis.base_metric,
        "num_layers": int(up.num_layers),
        "num_heads": int(up.num_heads),
        "attention": str(up.attention_name),
        "attention_options": dict(model_config.get("attention_options", {})),
        "model_config": model_config,
        "upstream": str(prepared.upstream_path),
        "upstream_sha256": prepared.upstream_sha256,
        "downstream": prepared.downstream,
        "split": prepared.split,
        "subset": analysis.subset,
        "seed": config.seed,
        "importance": {
            "per": imp.per,
            **{k: getattr(imp, k).double().tolist() for k in ("raw", "normalized", "signed")},
            "order": [list(x) for x in imp.order()],
        },
        "ablation": {
            name: None
            if getattr(ab, name) is None
            else {"metric": getattr(ab, name).tolist(), "delta": ab.delta(name).tolist()}
            for name in ("single", "keep_only", "layer")
        },
        "pruning": pruning,
        "config": {
            "num_batches": config.num_batches,
            "batch_size": config.batch_size,
            "dtype": config.dtype,
            "heads": asdict(config.heads),
        },
        "code_version": code_version(),
        "runtime_s": runtime_s,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


FigureWriter = Callable[[HeadsRecord, Path], list[Path]]  # (heads.json content, folder) -> PNGs


def run(
    cfg: DictConfig, datamodule: Any = None, figures: FigureWriter | None = None
) -> dict[str, Any]:
    """`python -m speechattn.analyze heads`: write heads.json and, with `cfg.figures`, the PNGs
    of `figures` (the report layer's, passed in by the entry point); returns its content plus
    `output_dir`, `heads_json` and `figures`. `datamodule`: instead of the recorded one."""
    quiet_library_notices()
    config: HeadsRunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    out = run_output_dir(cfg).resolve()
    t0 = time.perf_counter()
    prepare = prepare_pretrain if config.downstream is None else prepare_probe
    prepared = prepare(config, datamodule)
    runtime = {"load": round(time.perf_counter() - t0, 3)}
    log.info(
        "heads: %s on %s (%d x %d heads), subset %s",
        prepared.task,
        prepared.upstream.attention_name,
        prepared.upstream.num_layers,
        prepared.upstream.num_heads,
        prepared.objective.subset(),
    )
    try:
        analysis = analyze_heads(prepared.objective, config.heads, progress=config.progress)
    except NonFiniteMetricError as e:
        raise NonFiniteMetricError(f"upstream {prepared.upstream_path}: {e}") from e
    runtime.update(analysis.runtime_s, total=round(time.perf_counter() - t0, 3))
    result = result_dict(analysis, prepared, config, runtime)
    path = write_heads(result, out)
    drawn = figures(result, out) if config.figures and figures is not None else []
    logging.getLogger("speechattn.analyze").info(
        "heads: %s on %s, base %s %.4f -> %s",
        result["task"],
        result["attention"],
        result["metric"],
        result["base_metric"],
        path,
    )
    print(f"heads.json written to {path}", flush=True)
    return {
        **result,
        "output_dir": str(out),
        "heads_json": str(path),
        "figures": [str(p) for p in drawn],
    }
