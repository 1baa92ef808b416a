"""The model card (`README.md` + `loss_curve.png`, Hugging Face's layout: a YAML header of
facts and a Markdown body saying how to load it) beside every `upstream.pt`, and the upstream
folder for the Hub (`write_upstream_folder`). Every fact is read back from the written
upstream.pt and the run's `metrics.csv`; all files are written atomically.
"""

from __future__ import annotations

import io
import math
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import yaml

from speechattn.data.features import SAMPLE_RATE, FeatureConfig
from speechattn.model.upstream import (
    UPSTREAM_FOLDER,
    Upstream,
    load_upstream,
    save_upstream_folder,
    upstream_sha256,
    upstream_state,
)
from speechattn.tasks.common import read_metrics
from speechattn.utils import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from speechattn.tasks.pretrain.module import PretrainTask

CARD_FILE = "README.md"
LOSS_CURVE_FILE = "loss_curve.png"


def training_device(trainer: L.Trainer) -> str:
    """What trained the model, e.g. "cuda: NVIDIA H100 80GB HBM3 x 2" or "cpu: <model name>"."""
    device, count = trainer.strategy.root_device, trainer.world_size
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return f"{device.type}: {name}" + (f" x {count}" if count > 1 else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def median_metric(rows: list[dict[str, float]], key: str) -> float | None:
    """Median of a `metrics.csv` column over the rows that have it; None if none has."""
    values = [r[key] for r in rows if not math.isnan(r.get(key, math.nan))]
    return statistics.median(values) if values else None


def loss_curve_png(rows: list[dict[str, float]], title: str) -> bytes:
    """Train and validation L1 against the optimizer step, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = [(r["step"], r[key]) for r in rows if not math.isnan(r.get(key, math.nan))]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, style, label=key.replace("_", " "), markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked L1")
    ax.set_title(title)
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no losses logged", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def card_header(
    upstream_path: Path, rows: list[dict[str, float]], license: str, up: Upstream | None = None
) -> dict[str, Any]:
    """The YAML header's facts, from `upstream.pt` (`up`: loaded already) and `metrics.csv`."""
    up = up or load_upstream(upstream_path)
    meta, config = up.metadata, up.config
    summary = meta.get("data_summary") or {}
    train_s = summary.get("train_seconds")
    fps = meta.get("frames_per_s", median_metric(rows, "frames_per_s"))
    wait = meta.get("data_wait", median_metric(rows, "data_wait"))
    features = FeatureConfig(**up.feature_config)
    return {
        "library_name": "speechattn",
        "license": license,
        "pipeline_tag": "feature-extraction",  # the Hub's task for models giving hidden states
        "tags": ["speech", "self-supervised-learning", "aalbert", f"attention-{up.attention_name}"],
        "attention": up.attention_name,
        "attention_options": dict(meta.get("attention_options") or config.attention_options),
        "kernels": meta.get("kernels"),  # which kernel ran per length bucket, and how chosen
        "model": {
            "preset": meta.get("model_name") or None,
            "parameters": int(meta.get("num_params") or up.model.get_num_params(False)),
            "dim": config.dim,
            "num_layers": config.num_layers,
            "num_heads": config.num_heads,
            "ffn_dim": config.ffn_dim,
            "shared_layer": config.shared,
            "pre_norm": config.pre_norm,
            "frame_stack": config.stack,
        },
        "input": {
            "sample_rate": SAMPLE_RATE,
            "n_mels": features.n_mels,
            "deltas": features.deltas,
            "samples_per_frame": up.samples_per_frame,  # 480: one hidden state per 30 ms
        },
        "steps": meta.get("steps"),
        "corpus": meta.get("corpus"),
        "corpus_root": summary.get("root"),
        "train_utterances": summary.get("train_utterances"),
        "train_hours": None if train_s is None else round(train_s / 3600, 3),
        "final_train_loss": _rounded(meta.get("train_loss")),
        "final_val_loss": _rounded(meta.get("val_loss")),
        "frames_per_s": None if fps is None else round(float(fps)),
        "data_wait": _rounded(wait),
        "precision": meta.get("precision"),
        "device": meta.get("device"),
        "seed": meta.get("seed"),
        "code_version": meta.get("code_version"),
        # continued pretraining: the upstream it started from, {"path", "sha256"}
        "init_from": meta.get("init_from"),
        "upstream": upstream_path.name,
        "upstream_sha256": upstream_sha256(upstream_path),
    }


def _rounded(value: Any) -> float | None:
    return None if value is None else round(float(value), 6)


def card_body(header: dict[str, Any], upstream_name: str) -> str:
    """The Markdown under the header: what it is, the loss curve, how to load it."""
    h = header
    hours = f", {h['train_hours'] * 60:.1f} min of training audio" if h["train_hours"] else ""
    losses = f"final train L1 {h['final_train_loss']}, validation L1 {h['final_val_loss']}"
    if h.get("init_from"):
        losses += f"; continued from the upstream {h['init_from']['path']}"
    return f"""
# speechattn upstream: AALBERT with `{h["attention"]}` attention

A masked-reconstruction AALBERT ({h["model"]["num_layers"]} x {h["model"]["dim"]}, \
{h["model"]["num_heads"]} heads, {h["model"]["parameters"]:,} parameters) pretrained by \
speechattn for {h["steps"]} steps on the `{h["corpus"]}` corpus{hours}; {losses}. \
Input: {h["input"]["sample_rate"] // 1000} kHz audio ({h["input"]["n_mels"]}-bin log-mel); \
output: one hidden state per {h["input"]["samples_per_frame"]} samples for the input \
embedding and each layer.

![training and validation loss]({LOSS_CURVE_FILE})

## Load it

Paths are relative to this folder. speechattn:

```python
import speechattn
up = speechattn.load_upstream("{upstream_name}")
feats, frames = up.features_from_waveforms(wavs, sample_counts)   # (B, S) 16 kHz, (B,)
hidden = up(feats, frames).hidden_states                         # L+1 x (B, T', D)
out = up(feats, frames, output_attentions=True)                  # + attentions, L x (B, h, T', T')
```

torch.hub, from a checkout of speechattn:

```python
up = torch.hub.load("path/to/speechattn", "speechattn_upstream", source="local", ckpt="{upstream_name}")
```

s3prl (`pip install 'speechattn[s3prl]'`), e.g. under its `Featurizer`:

```python
from speechattn.interop.s3prl import UpstreamExpert
expert = UpstreamExpert("{upstream_name}")
expert([wav_a, wav_b])["hidden_states"]   # 1-D 16 kHz tensors in; downsample rate 480
```

SUPERB with s3prl's `run_downstream.py`: see "Using upstreams in other tools" in speechattn's
README.
"""


def write_model_card(
    upstream_path: str | Path, rows: list[dict[str, float]], license: str = "mit"
) -> Path:
    """Write `README.md` and `loss_curve.png` beside `upstream_path` for the run's `metrics.csv`
    `rows` (`speechattn.tasks.common.read_metrics`); returns the card's path."""
    return _write_card(Path(upstream_path), rows, license)


def write_upstream_folder(
    upstream_path: str | Path, out: str | Path, rows: list[dict[str, float]], license: str = "mit"
) -> Path:
    """Export `upstream_path` (an upstream.pt) as an upstream folder at `out`, written
    atomically (docs/upstream.md), loading to the same module bit for bit; `OutputExistsError`
    when `out` holds anything but an earlier upstream folder."""
    _write_card(Path(upstream_path), rows, license, beside=False, folder=Path(out))
    return Path(out)


def _write_card(
    upstream_path: Path,
    rows: list[dict[str, float]],
    license: str,
    beside: bool = True,
    folder: Path | None = None,
) -> Path:
    """The model card beside `upstream_path` (`beside`) and/or the upstream folder at `folder`,
    from one load, hash and loss curve; returns the path of the card beside upstream.pt."""
    up = load_upstream(upstream_path)
    header = card_header(upstream_path, rows, license, up)
    png = loss_curve_png(rows, f"AALBERT, {header['attention']} attention")
    if beside:
        atomic_write_bytes(upstream_path.parent / LOSS_CURVE_FILE, png)
        atomic_write_text(upstream_path.parent / CARD_FILE, card_text(header, upstream_path.name))
    if folder is not None:
        state = upstream_state(up.model, up.normalizer, up.feature_config, up.metadata)
        source = {"file": upstream_path.name, "sha256": header["upstream_sha256"]}
        files = {CARD_FILE: card_text(header, ".").encode("utf-8"), LOSS_CURVE_FILE: png}
        save_upstream_folder(folder, state, source, files)
    return upstream_path.parent / CARD_FILE


def card_text(header: dict[str, Any], upstream_name: str) -> str:
    """The card: YAML front matter (Hugging Face's model-card metadata) + Markdown body."""
    return f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n{card_body(header, upstream_name)}"


def write_run_upstream(
    trainer: L.Trainer, task: PretrainTask, output_dir: Path, val_loss: float | None, license: str
) -> dict[str, str]:
    """The results of a run that finished in `output_dir` (rank zero's): `upstream.pt` with the
    run's facts (final `val_loss`, throughput, precision, device), its model card and the
    upstream folder; returns their paths as `upstream`, `model_card` and `upstream_folder`."""
    rows = read_metrics(output_dir / "metrics.csv")
    run_facts = {
        "val_loss": val_loss,
        "frames_per_s": median_metric(rows, "frames_per_s"),
        "data_wait": median_metric(rows, "data_wait"),
        "precision": str(trainer.precision),
        "device": training_device(trainer),
    }
    upstream = task.export_upstream(output_dir / "upstream.pt", run_facts)
    folder = output_dir / UPSTREAM_FOLDER
    card = _write_card(upstream, rows, license, folder=folder)
    print(
        f"upstream.pt written to {upstream} (model card: {card}; as a safetensors folder: "
        f"{folder})",
        flush=True,
    )
    return {"upstream": str(upstream), "model_card": str(card), "upstream_folder": str(folder)}
