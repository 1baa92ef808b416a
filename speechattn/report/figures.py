"""Figures of the report: attention maps (study Fig. 2), speaker accuracy vs keys attended
(study Fig. 4), ABX error per layer, and per head analysis (`heads.json` of `python -m
speechattn.analyze heads`) its importance and ablation heat-maps and pruning curve, with an
overlay of the pruning curves of several variants.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from speechattn import load_upstream  # noqa: E402
from speechattn.data.features import SAMPLE_RATE, FeatureConfig  # noqa: E402
from speechattn.errors import ConfigError  # noqa: E402
from speechattn.model.serialization import load_torch_file  # noqa: E402
from speechattn.report.results import ResultSet  # noqa: E402
from speechattn.report.tables import attention_facts  # noqa: E402
from speechattn.tasks.records import MEL, find_heads, read_heads  # noqa: E402

SPEAKER_TASK = "speaker_utterance"


def accuracy_vs_keys(results: ResultSet, seq_len: int, path: Path) -> Path | None:
    """Speaker accuracy vs keys attended per query at `seq_len`; None when nothing to plot."""
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
    """ABX error (%) per layer, within and across speakers, mel (no layers) dashed; None
    without ABX results."""
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
    """Every head's attention weights (the variant's dense reference) in `layer` (1-based) for
    the test utterance a downstream run saved (`example_utterance.pt`), each column under its
    log-mel spectrogram on one time axis in seconds; at most `max_frames` model frames."""
    from librosa.display import specshow

    upstream = load_upstream(upstream_path).eval()
    example = load_torch_file(example_path, "cpu", "attention-map example")
    features = example["features"][None]  # (1, T, F)
    if not 1 <= layer <= upstream.num_layers:
        raise ConfigError(f"layer {layer} out of range: the upstream has {upstream.num_layers}")
    with torch.no_grad():
        weights = upstream.attention_weights(features, torch.tensor([features.size(1)]), layer)
    weights = weights[0, :, :max_frames, :max_frames].float()  # (h, T', T') of (1, h, T', T')
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


# ----------------------------------------------------------------------------- heads

METRIC_LABELS = {"l1_loss": "masked-reconstruction L1", "accuracy": "accuracy"}
ABLATIONS = {"single": "head masked (ξ_lh = 0)", "keep_only": "only this head kept in its depth"}
CURVE_MARKERS = "os^vDP*Xph<>"  # cycled with tab20 colours so that 14+ overlaid curves differ


def save_figure(fig: Any, path: str | Path, dpi: int = 130) -> Path:
    """Lay `fig` out, write it to `path` (PNG) and close it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def _title(r: dict[str, Any]) -> str:
    return f"{r['attention']} · {r['task']}"


def _annotate(ax: Any, values: np.ndarray, fmt: str, diverging: bool = False) -> None:
    """Write each cell's value; skipped when the grid is too dense to read."""
    L, h = values.shape
    if L * h > 144:  # the colour bar carries the scale
        return
    size = 8 if L * h <= 48 else 6
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    for i in range(L):
        for j in range(h):
            v = values[i, j]
            # dark cells: low end of viridis, or either end of the diverging map
            dark = abs(v) > 0.6 * top if diverging else v < 0.5 * top
            color = "white" if dark else "black"
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=size, color=color)


def _delta_scale(values: np.ndarray) -> tuple[np.ndarray, str, str]:
    """(values to print, format, unit note): deltas below 0.01 in units of 10^e, to stay short."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    if top == 0.0 or top >= 0.01:
        return values, "+.3f", ""
    e = math.floor(math.log10(top))
    return values / 10.0**e, "+.1f", f" (×1e{e})"


def _axes_labels(ax: Any, L: int, h: int) -> None:
    ax.set_xticks(range(h))
    ax.set_yticks(range(L), [str(i + 1) for i in range(L)])
    ax.set_xlabel("head")
    ax.set_ylabel("depth (layer application)")


def importance_heatmap(r: dict[str, Any], path: Path) -> Path:
    """Normalised importance (depth x head): each depth's row has unit L2 norm."""
    values = np.asarray(r["importance"]["normalized"], dtype=float)  # (L, h)
    L, h = values.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * h, 1.2 + 0.45 * L))
    im = ax.imshow(values, cmap="viridis", aspect="auto", vmin=0.0, vmax=max(1e-12, values.max()))
    _annotate(ax, values, ".2f")
    _axes_labels(ax, L, h)
    fig.colorbar(im, ax=ax, label="importance / per-depth L2 norm")
    per = r["importance"].get("per", "utterance")
    ax.set_title(f"{_title(r)}\nhead importance E|∂L/∂ξ| (per {per})", fontsize=9)
    return save_figure(fig, path)


def ablation_heatmap(r: dict[str, Any], path: Path) -> Path | None:
    """Δ metric (ablated - unmasked) per head with one head masked, and with only one head
    kept per depth; red always means worse. None when no ablation was run."""
    panels = [key for key in ABLATIONS if r["ablation"].get(key) is not None]
    if not panels:
        return None
    L, h = r["num_layers"], r["num_heads"]
    cmap = "RdBu" if r["higher_is_better"] else "RdBu_r"  # red = worse either way
    fig, axes = plt.subplots(
        1, len(panels), figsize=(len(panels) * (1.6 + 0.55 * h), 1.4 + 0.45 * L), squeeze=False
    )
    metric = METRIC_LABELS.get(r["metric"], r["metric"])
    for ax, key in zip(axes[0], panels):
        delta = np.asarray(r["ablation"][key]["delta"], dtype=float)
        limit = max(1e-12, float(np.abs(delta).max()))
        im = ax.imshow(delta, cmap=cmap, aspect="auto", vmin=-limit, vmax=limit)
        shown, fmt, unit = _delta_scale(delta)
        _annotate(ax, shown, fmt, diverging=True)
        _axes_labels(ax, L, h)
        ax.set_title(ABLATIONS[key] + unit, fontsize=9)
        fig.colorbar(im, ax=ax, label=f"Δ {metric}")
    fig.suptitle(f"{_title(r)}: ablation (base {metric} {r['base_metric']:.4f})", fontsize=10)
    return save_figure(fig, path)


def _curve(r: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    points = r["pruning"]["points"]
    x = np.array([100.0 * p["fraction"] for p in points])
    y = np.array([p["metric"] for p in points])
    return x, y


def _variant_label(r: dict[str, Any]) -> str:
    p = r["pruning"]
    flags = [
        f for f, on in (("recompute", p["recompute"]), ("guard", p["keep_one_per_layer"])) if on
    ]
    return r["attention"] + (f" ({', '.join(flags)})" if flags else "")


def pruning_plot(r: dict[str, Any], path: Path) -> Path | None:
    """Metric vs % of heads pruned in increasing order of importance. None without a curve."""
    if not r.get("pruning"):
        return None
    x, y = _curve(r)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, y, marker="o", label=_variant_label(r))
    ax.axhline(r["base_metric"], color="grey", linestyle="--", linewidth=1, label="unpruned")
    ax.set_xlabel(f"heads pruned (% of {r['num_layers']} x {r['num_heads']})")
    ax.set_ylabel(METRIC_LABELS.get(r["metric"], r["metric"]))
    ax.set_xlim(-2, 102)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{_title(r)}: pruning by importance", fontsize=10)
    return save_figure(fig, path)


def head_figures(
    result: dict[str, Any] | str | Path, out_dir: str | Path, prefix: str = "heads"
) -> list[Path]:
    """`<prefix>_{importance,ablation,pruning}.png` in out_dir (the last two when run)."""
    r = result if isinstance(result, dict) else read_heads(result)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [importance_heatmap(r, out / f"{prefix}_importance.png")]
    written.append(ablation_heatmap(r, out / f"{prefix}_ablation.png"))
    written.append(pruning_plot(r, out / f"{prefix}_pruning.png"))
    return [p for p in written if p is not None]


def write_head_figures(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Each head analysis' figures (run dirs or heads.json) as `heads_<attention>_<task>[_k]_*`."""
    out = Path(out_dir)
    written: list[Path] = []
    seen: dict[str, int] = defaultdict(int)
    for item in run_dirs:
        r = read_heads(item)
        stem = f"heads_{r['attention']}_{r['task']}"
        seen[stem] += 1
        if seen[stem] > 1:
            stem = f"{stem}_{seen[stem]}"
        written += head_figures(r, out, prefix=stem)
    return written


def overlay_pruning_curves(
    heads_json_paths: list[str | Path], out_png: str | Path, relative: bool = False
) -> Path | None:
    """Pruning curves of several analyses, one panel per (task, metric), with `relative` each
    divided by its unpruned metric; None when no input has a pruning curve."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in heads_json_paths:
        r = read_heads(p)
        if r.get("pruning"):
            groups[(r["task"], r["metric"])].append(r)
    if not groups:
        return None
    n = len(groups)
    cols = min(2, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for i, ((task, metric), results) in enumerate(sorted(groups.items())):
        ax = axes[i // cols][i % cols]
        for k, r in enumerate(sorted(results, key=lambda r: r["attention"])):
            x, y = _curve(r)
            if relative:
                y = y / r["base_metric"] if r["base_metric"] else y
            colour = plt.get_cmap("tab20")(k % 20)
            marker = CURVE_MARKERS[k % len(CURVE_MARKERS)]
            ax.plot(x, y, color=colour, marker=marker, markersize=3, label=_variant_label(r))
        label = METRIC_LABELS.get(metric, metric)
        ax.set_ylabel(f"{label} / unpruned" if relative else label)
        ax.set_xlabel("heads pruned (%)")
        ax.set_xlim(-2, 102)
        ax.set_title(task, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("Pruning heads in increasing order of importance", fontsize=11)
    return save_figure(fig, out_png)


def head_summary_markdown(heads_json_paths: list[str | Path]) -> str:
    """Markdown table: each analysis' metric unpruned, ~50 % and fully pruned, top head."""
    lines = [
        "| variant | task | metric | unpruned | ~50 % pruned | 100 % / last | most important (depth, head) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in heads_json_paths:
        r = read_heads(p)
        half = last = "–"
        if r.get("pruning"):
            points = r["pruning"]["points"]
            mid = min(points, key=lambda q: abs(q["fraction"] - 0.5))
            half = f"{mid['metric']:.4f} ({100 * mid['fraction']:.0f} %)"
            last = f"{points[-1]['metric']:.4f} ({100 * points[-1]['fraction']:.0f} %)"
        top = r["importance"]["order"][-1] if r["importance"].get("order") else None
        top_s = f"({top[0] + 1}, {top[1]})" if top else "–"
        lines.append(
            f"| {r['attention']} | {r['task']} | {r['metric']} | {r['base_metric']:.4f} | "
            f"{half} | {last} | {top_s} |"
        )
    return "\n".join(lines) + "\n"


def head_report(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """The head analyses under `results_dir`: their figures, the pruning overlay, `heads.md`."""
    paths = find_heads(results_dir)
    if not paths:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = write_head_figures(paths, out)
    overlay = overlay_pruning_curves(paths, out / "fig_heads_pruning.png")
    if overlay is not None:
        written.append(overlay)
    md = out / "heads.md"
    md.write_text(
        "# Head importance and pruning\n\n"
        "Importance E|∂L/∂ξ| normalised per depth (Michel et al. 2019); pruning masks heads in "
        "increasing order of importance. Depths are 1-based, heads 0-based.\n\n"
        + head_summary_markdown(paths)
    )
    written.append(md)
    return written
