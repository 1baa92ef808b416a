"""Figures of the report: attention maps of every head under the utterance's log-mel
spectrogram (study Fig. 2; `librosa.display.specshow`, time in seconds on both),
utterance-level speaker accuracy vs keys attended (study Fig. 4) and ABX error per layer."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from speechattn.data.features import SAMPLE_RATE, FeatureConfig  # noqa: E402
from speechattn.errors import ConfigError
from speechattn.model.serialization import load_torch_file  # noqa: E402
from speechattn.report.heads import save_figure  # noqa: E402
from speechattn.report.results import ResultSet  # noqa: E402
from speechattn.report.tables import attention_facts  # noqa: E402
from speechattn.tasks.records import MEL  # noqa: E402

SPEAKER_TASK = "speaker_utterance"


def accuracy_vs_keys(results: ResultSet, seq_len: int, path: Path) -> Path | None:
    """Scatter of `speaker_utterance` test accuracy against keys attended per query at
    `seq_len` (symmetric log scale, so 0 keys fits); the mel baseline as a dashed line. None when nothing to plot."""
    points = []
    for variant in results.variants():
        acc = results.accuracy(variant, SPEAKER_TASK)
        if acc is None or variant == MEL:
            continue
        keys = attention_facts(variant, seq_len).get("keys_attended")
        if keys is not None:
            points.append((variant, keys, acc))
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, keys, acc in points:
        ax.scatter(keys, acc, s=36)
        ax.annotate(name, (keys, acc), textcoords="offset points", xytext=(4, 3), fontsize=8)
    mel = results.accuracy(MEL, SPEAKER_TASK)
    if mel is not None:
        ax.axhline(mel, color="grey", linestyle="--", linewidth=1, label="mel (no pretraining)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("symlog", linthresh=1.0)  # synthesizers attend 0 keys (no query-key scores)
    ax.set_xlabel(f"keys attended per query (T = {seq_len} frames)")
    ax.set_ylabel("utterance-level speaker accuracy (test)")
    ax.set_title("Speaker accuracy vs keys attended")
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path)


def abx_by_layer(results: ResultSet, path: Path) -> Path | None:
    """ABX error (%) against layer, within (left) and across speakers (right), one line per
    variant; mel, which has no layers, as a dashed line. None when nothing to plot."""
    if not results.abx:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, ("within", "across"), strict=True):
        for variant in results.abx_variants():
            errors = results.abx[variant][1].errors(mode)
            points = sorted((k, 100 * e) for k, e in errors.items() if e is not None)
            if variant == MEL and points:
                ax.axhline(points[0][1], color="grey", linestyle="--", linewidth=1, label=MEL)
            elif points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant)
        ax.set_xlabel("layer (0 = input embedding)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"ABX {mode} speaker" + ("s" if mode == "across" else ""))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ABX error (%)")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path)


def attention_maps(
    upstream_path: str | Path,
    example_path: str | Path,
    path: Path,
    layer: int = 1,
    max_frames: int = 200,
) -> Path:
    """Every head's attention weights in `layer` (1-based) for one utterance, as a grid, each
    column under the utterance's log-mel spectrogram on the same time axis (seconds).

    The utterance is the normalised test utterance a downstream run saved beside its result
    (`example_utterance.pt`); the weights come from the upstream's `attention_weights`, i.e. the
    variant's dense reference. At most `max_frames` model frames are drawn.
    """
    from librosa.display import specshow

    from speechattn import load_upstream

    upstream = load_upstream(upstream_path).eval()
    example = load_torch_file(example_path, "cpu", "attention-map example")
    features = example["features"][None]  # (1, T, F)
    lengths = torch.tensor([features.size(1)])
    if not 1 <= layer <= upstream.num_layers:
        raise ConfigError(f"layer {layer} out of range: the upstream has {upstream.num_layers}")
    with torch.no_grad():
        weights = upstream.attention_weights(features, lengths, layer)  # (1, h, T', T')
    weights = weights[0, :, :max_frames, :max_frames].float()  # (h, T', T')
    heads, shown = weights.size(0), weights.size(-1)
    fc = FeatureConfig(**upstream.feature_config)
    seconds = shown / upstream.frame_rate  # the maps' time span
    mel = features[0, : shown * upstream.downsample, : fc.n_mels].float().numpy().T  # (F, T)
    cols = min(4, heads)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(
        rows + 1,
        cols,
        figsize=(3 * cols, 3 * rows + 1.2),
        squeeze=False,
        gridspec_kw={"height_ratios": [0.4, *[1] * rows]},
    )
    for c in range(cols):  # the spectrogram over each column: one time axis for all panels
        ax = axes[0][c]
        specshow(
            mel,
            sr=SAMPLE_RATE,
            hop_length=fc.hop_length,
            x_axis="time",
            y_axis="mel",
            fmin=fc.f_min,
            fmax=fc.f_max,
            ax=ax,
            cmap="magma",
        )
        ax.set_xlim(0, seconds)
        ax.set_xlabel("time (s)", fontsize=7)
        ax.set_ylabel("log-mel (Hz)" if c == 0 else "", fontsize=7)
        ax.tick_params(labelsize=7)
    for h in range(rows * cols):
        ax = axes[1 + h // cols][h % cols]
        ax.set_xticks([])
        ax.set_yticks([])
        if h >= heads:
            ax.axis("off")
            continue
        ax.imshow(
            weights[h].numpy(),
            cmap="viridis",
            aspect="auto",
            interpolation="nearest",
            extent=(0, seconds, seconds, 0),  # keys (x) and queries (y) in seconds
        )
        ax.set_xlim(0, seconds)
        ax.set_title(f"head {h}", fontsize=9)
    name = getattr(upstream, "attention_name", "?")
    fig.suptitle(
        f"{name}: layer {layer}, utterance {example.get('utt_id', '?')} "
        f"(rows: queries, cols: keys; {seconds:.2f} s)",
        fontsize=10,
    )
    return save_figure(fig, path, dpi=110)
