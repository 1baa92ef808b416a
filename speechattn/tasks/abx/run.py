"""The ABX job: `run(cfg)`, what `python -m speechattn.abx` does (docs/abx.md): one split's
hidden states, extracted as for the downstream probes, scored layer by layer into `abx.json`."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from speechattn import code_version
from speechattn.data.datamodules import build_datamodule
from speechattn.errors import ConfigError, MissingFileError, require
from speechattn.tasks.abx.score import DISTANCES, abx_score, frame_span, triphone_items
from speechattn.tasks.common import run_output_dir
from speechattn.tasks.downstream.features import (
    SPLITS,
    extract,
    feature_normalization,
    open_upstream,
    resolve_layers,
)
from speechattn.tasks.downstream.labels.phones import missing_alignments
from speechattn.tasks.downstream.run import check_input_frames, upstream_name
from speechattn.tasks.records import AbxRecord
from speechattn.utils import choose_device, plain

log = logging.getLogger(__name__)


@dataclass
class AbxConfig:
    """`python -m speechattn.abx`: its groups and its own keys."""

    data: Any = None  # DataConfig (or a DataModule's `_target_`) with frame-level phone labels
    upstream: str = "mel"  # an upstream.pt from `python -m speechattn.pretrain`, or `mel`
    layer: Any = "all"  # all | last | index (0 = input embedding, as the downstream probes)
    split: str = "test"  # train | dev | test of the labelled corpus
    distance: str = "angular"  # frame distance: angular (arccos(cos) / pi) | cosine (1 - cos)
    device: str = "auto"  # feature extraction device: auto | cpu | cuda
    normalization: str = "upstream"  # as the downstream job's: upstream | corpus
    output_dir: str | None = None  # null: the Hydra run dir


def abx_layers(layer: Any, num_layers: int) -> list[int]:
    """Hidden states to score: `all` -> 0..L, else `resolve_layers` (last | index)."""
    if layer == "all":
        return list(range(num_layers + 1))
    if layer == "weighted":
        raise ConfigError(
            "layer=weighted is a learned mix of the probes; ABX takes all, last or an index"
        )
    return resolve_layers(layer, num_layers)


def check_alignments(datamodule: Any) -> None:
    """Fail before extracting anything when the corpus has no phone alignments to make items of."""
    cfg = getattr(datamodule, "cfg", None)
    if cfg is None or not hasattr(datamodule, "corpus"):
        return  # a DataModule of its own: checked on its batches
    path = None if cfg.alignments is None else datamodule.corpus.missing_labels()
    if cfg.alignments is None or path is not None:
        missing_alignments("ABX", cfg.alignments, path, MissingFileError)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Score `cfg.upstream`'s layers on `cfg.split`; writes `abx.json` and returns it as a dict."""
    t_start = time.perf_counter()
    require(cfg.split in SPLITS, "split", cfg.split, f"one of {', '.join(SPLITS)}")
    require(cfg.distance in DISTANCES, "distance", cfg.distance, f"one of {', '.join(DISTANCES)}")
    out = run_output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    datamodule = build_datamodule(cfg.data, "labelled")
    check_alignments(datamodule)
    data_config = getattr(datamodule, "cfg", None)
    upstream, sha = open_upstream(cfg.upstream, datamodule.feature_dim, data_config)
    layers = abx_layers(cfg.layer, upstream.num_layers)
    datamodule.prepare_data()
    datamodule.setup("fit")
    check_input_frames(upstream, datamodule)
    normalization = feature_normalization(datamodule.normalizer, upstream, cfg.normalization)
    t_features = time.perf_counter()
    device, progress = choose_device(cfg.device), bool(getattr(data_config, "progress", False))
    features = extract(upstream, datamodule, cfg.split, layers, normalization, device, progress)
    upstream.cpu()
    t_features = time.perf_counter() - t_features
    if features.phones is None:
        raise ConfigError(f"ABX needs phone labels: the {cfg.split} split has none")
    t_score = time.perf_counter()
    phones = [features.phones_of(i).numpy() for i in range(len(features))]
    speakers = features.speakers if features.speakers is not None else torch.zeros(len(phones))
    items = triphone_items(phones, speakers.long().numpy())
    lengths = features.lengths.numpy()
    first, stop = frame_span(items.start, items.end, upstream.downsample, lengths[items.utt])
    keep = stop > first
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    scores = []
    for k, layer in enumerate(layers):
        score = abx_score(
            features.features[:, k],
            offsets,
            items.subset(keep),
            first[keep],
            stop[keep],
            cfg.distance,
        )
        scores.append({"layer": layer, **asdict(score)})
        log.info(
            "ABX layer %d: within %s, across %s",
            layer,
            _percent(score.within),
            _percent(score.across),
        )
    runtime = {"features": t_features, "score": time.perf_counter() - t_score}
    runtime["total"] = time.perf_counter() - t_start
    record = AbxRecord(
        upstream=upstream_name(cfg.upstream),
        upstream_sha256=sha,
        attention=upstream.attention_name,
        split=cfg.split,
        distance=cfg.distance,
        frame_ms=10.0 * upstream.downsample,
        layers=scores,
        items={
            "total": len(items),
            "scored": int(keep.sum()),
            "no_frames": int((~keep).sum()),
            "utterances": len(features),
            "speakers": len(np.unique(speakers.numpy())),
        },
        settings={**plain(cfg), "data": plain(data_config) if data_config else plain(cfg.data)},
        normalization=normalization.record,
        runtime_s={k: round(v, 2) for k, v in runtime.items()},
        code_version=code_version(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    path = record.write(out)
    log.info("ABX of %s on %s (%d items) -> %s", record.attention, cfg.split, len(items), path)
    return record.to_dict()


def _percent(error: float | None) -> str:
    return "–" if error is None else f"{100 * error:.2f} %"
