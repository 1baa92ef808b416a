"""The report's tables as Markdown and CSV: cost (Table 1), accuracy (Table 2, with the study's
numbers), ABX per layer, SUPERB and learned spans. Missing entries are gaps, never errors."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechattn import load_upstream
from speechattn.report.results import BenchRecord, ResultSet, read_newest, registry_order
from speechattn.tasks.records import (
    MEL,
    SUPERB_FILE,
    TASKS,
    WEIGHTED_SUM,
    SuperbResult,
    read_superb,
)

log = logging.getLogger(__name__)

GAP = "–"
TASK_TITLES = {
    "speaker_utterance": "speaker (utterance)",
    "speaker_frame": "speaker (frame)",
    "phone_1hidden": "phone (1 hidden)",
    "phone_2hidden": "phone (2 hidden)",
}
# Dimensions at which Table 1 counts attention parameters: the study's AALBERT (aalbert_base).
STUDY_DIM, STUDY_HEADS = 768, 12
# The study's LibriSpeech test accuracies (its Table 2; setting in docs/report.md), columns in
# TASKS' order; variants it did not include have no row.
REFERENCE: dict[str, tuple[float, float, float, float]] = {
    "mel": (0.0060, 0.0033, 0.5246, 0.5768),
    "full": (0.9926, 0.9824, 0.6460, 0.6887),
    "shared_qk": (0.9898, 0.9622, 0.5893, 0.6345),
    "sparse_strided": (0.9786, 0.9039, 0.6048, 0.6450),
    "sparse_fixed": (0.9597, 0.7960, 0.6069, 0.6846),
    "sign_alsh": (0.9716, 0.8237, 0.5863, 0.6393),
    "xbox": (0.9639, 0.7994, 0.5860, 0.6262),
    "xbox_qnf": (0.9667, 0.7958, 0.5819, 0.6241),
    "simple_lsh": (0.9628, 0.7370, 0.5771, 0.6189),
    "simple_alsh": (0.9678, 0.7999, 0.5783, 0.6214),
    "syn_dense": (0.9660, 0.9027, 0.6180, 0.6287),
    "syn_dense_mh": (0.9509, 0.9135, 0.6073, 0.6471),
    "syn_random": (0.9803, 0.8868, 0.5820, 0.6237),
    "syn_fixed": (0.9842, 0.9855, 0.6157, 0.6492),
}


@dataclass
class Table:
    """Header + rows of cells (None = gap) + optional per-cell emphasis."""

    header: list[str]
    rows: list[list[Any]]
    bold: set[tuple[int, int]]

    def markdown(self, digits: int = 4) -> str:
        def cell(value: Any, r: int, c: int) -> str:
            if value is None:
                return GAP
            text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
            return f"**{text}**" if (r, c) in self.bold else text

        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        for r, row in enumerate(self.rows):
            lines.append("| " + " | ".join(cell(v, r, c) for c, v in enumerate(row)) + " |")
        return "\n".join(lines) + "\n"

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.header)
            writer.writerows(["" if v is None else v for v in row] for row in self.rows)


def mark_best(rows: list[list[Any]], columns: range, best: Any = max) -> set[tuple[int, int]]:
    """(row, column) of the maximum (`best=min`: minimum) of each column (ties all marked)."""
    bold = set()
    for c in columns:
        values = [row[c] for row in rows if isinstance(row[c], float)]
        if values:
            top = best(values)
            bold |= {(r, c) for r, row in enumerate(rows) if row[c] == top}
    return bold


def accuracy_table(results: ResultSet, tasks: list[str], variants: list[str]) -> Table:
    """Test accuracy per variant (rows) and task; best in bold; rows of one model say so."""
    options = {}
    for v in variants:  # the attention options each upstream was pretrained with
        found = (results.get(v, t) for t in results.tasks())
        config = next((r.model_config for r in found if r is not None and r.model_config), {})
        options[v] = config.get("attention_options") or {}
    return _task_table(tasks, variants, results.accuracy, same_models(variants, options))


def reference_table(tasks: list[str], variants: list[str]) -> Table:
    """The study's LibriSpeech accuracies (its Table 2) for the same rows, best in bold."""
    names = [v for v in variants if v in REFERENCE] + [v for v in REFERENCE if v not in variants]
    return _task_table(tasks, names, _reference_accuracy)


def _reference_accuracy(variant: str, task: str) -> float | None:
    row = REFERENCE.get(variant)
    return None if row is None or task not in TASKS else row[TASKS.index(task)]


def _task_table(
    tasks: list[str], variants: list[str], value: Any, same: dict[str, str] | None = None
) -> Table:
    """`value(variant, task)` per variant (rows) and task (columns), highest per column bold."""
    header = ["variant", *[TASK_TITLES.get(t, t) for t in tasks]]
    rows = [[_label(v, same or {}), *[value(v, t) for t in tasks]] for v in variants]
    return Table(header, rows, mark_best(rows, range(1, len(header))))


def same_models(
    variants: list[str], options: dict[str, dict[str, Any]] | None = None
) -> dict[str, str]:
    """Rows that are the same model as an earlier row (LSH schemes with equal match counts,
    `attention.lsh.same_model`), mapped to it; `options` default to the registry's. One head of
    the study's head size decides: every head hashes with the layer's one projection."""
    from speechattn.attention import build
    from speechattn.attention.lsh import SCHEMES, same_model

    head = STUDY_DIM // STUDY_HEADS
    built = {v: build(v, head, 1, **(options or {}).get(v, {})) for v in variants if v in SCHEMES}
    same: dict[str, str] = {}
    names = list(built)
    for i, v in enumerate(names):
        first = next(
            (u for u in names[:i] if u not in same and same_model(built[u], built[v])), None
        )
        if first is not None:
            same[v] = first
    return same


def abx_table(results: ResultSet) -> Table:
    """ABX error in % per variant (rows), layer and within/across (columns); lowest in bold."""
    found = results.abx_variants()
    layers = sorted({k for v in found for k in results.abx[v][1].errors("within")})
    header = ["variant", *[f"L{k} {mode}" for k in layers for mode in ("within", "across")]]
    rows = []
    for v in found:
        errors = {mode: results.abx[v][1].errors(mode) for mode in ("within", "across")}
        cells = [errors[mode].get(k) for k in layers for mode in ("within", "across")]
        rows.append([_label(v, {}), *[None if e is None else 100 * e for e in cells]])
    return Table(header, rows, mark_best(rows, range(1, len(header)), best=min))


def _label(variant: str, same: dict[str, str]) -> str:
    if variant == MEL:
        return "mel (no pretraining)"
    return f"{variant} (same model as {same[variant]})" if variant in same else variant


# ----------------------------------------------------------------------------- table 1

FACTS = ("complexity_training", "complexity_inference", "keys_attended", "attention_params")


def attention_facts(variant: str, seq_len: int) -> dict[str, Any]:
    """Complexity, keys attended at `seq_len` and parameters of one attention layer at the
    study's size, from the attention registry; {} when the variant cannot be built."""
    try:
        from speechattn.attention import build

        module = build(variant, STUDY_DIM, STUDY_HEADS)
    except Exception as e:  # a variant missing from this checkout, or the library absent
        log.info("table 1: cannot build %s (%s)", variant, e)
        return {}
    return {
        "complexity_training": getattr(module, "complexity_training", None) or None,
        "complexity_inference": getattr(module, "complexity_inference", None) or None,
        "keys_attended": float(module.keys_attended(seq_len)),
        "attention_params": sum(p.numel() for p in module.parameters()),
    }


def cost_table(
    results: ResultSet, bench: list[BenchRecord], seq_len: int, max_lengths: int | None = None
) -> Table:
    """Per variant: complexity, keys attended at `seq_len`, parameters, and measured time and
    memory per benchmarked length (at most `max_lengths`, spread from shortest to longest)."""
    names = registry_order() or [v for v in results.variants() if v != MEL]
    found = results.variants() + sorted({r.variant for r in bench})
    variants = names + [v for v in found if v not in names and v != MEL]
    lengths = sorted({r.seq_len for r in bench})
    if max_lengths is not None and len(lengths) > max_lengths:  # smallest, ..., largest
        step = (len(lengths) - 1) / (max_lengths - 1)
        lengths = sorted({lengths[round(i * step)] for i in range(max_lengths)})
    by_key = {(r.variant, r.seq_len): r for r in bench}
    same = same_models(variants)
    header = ["variant", "time complexity (training)", "time complexity (inference)"]
    header += [f"keys attended (T={seq_len})"]
    header += [f"attention params/layer (D={STUDY_DIM}, h={STUDY_HEADS})", "upstream params"]
    header += [f"time ms (T={n})" for n in lengths] + [f"peak MiB (T={n})" for n in lengths]
    rows = []
    for v in variants:
        facts = attention_facts(v, seq_len)
        upstream_params = next(
            (r.upstream_parameters for t in results.tasks() if (r := results.get(v, t))), None
        )
        row = [_label(v, same), *(facts.get(k) for k in FACTS), upstream_params or None]
        row += [getattr(by_key.get((v, n)), "time_ms", None) for n in lengths]
        row += [getattr(by_key.get((v, n)), "memory_mb", None) for n in lengths]
        rows.append(row)
    return Table(header, rows, mark_best(rows, range(6, len(header)), best=min))  # lowest cost


# ----------------------------------------------------------------------------- SUPERB
# `superb_result.json` files, upstream (rows) x task (columns): a row is one upstream run (or
# s3prl baseline), feature selection and --quick or not (docs/superb.md); newest per cell.

# s3prl downstream -> column title
COLUMNS = {"speech_commands": "KS acc ↑", "voxceleb1": "SID acc ↑", "ctc": "PR PER ↓"}


def collect_superb(root: str | Path) -> tuple[dict[tuple[str, str], SuperbResult], list[str]]:
    """{(row, task): newest result} of every superb_result.json under `root`, and problems."""
    problems: list[str] = []
    found, _ = read_newest(
        root, SUPERB_FILE, read_superb, lambda r: (row_label(r), r.task), problems
    )
    return {key: result for key, (_, result) in found.items()}, problems


def row_label(result: SuperbResult) -> str:
    """'ldsa (run 2026-11-28_10-00-00, layer 3) (quick)': variant, upstream run folder,
    selection unless the weighted sum, quick."""
    parts = []
    if result.upstream_ckpt:
        parts.append(f"run {Path(result.upstream_ckpt).parent.name}")
    if result.selection != WEIGHTED_SUM:
        parts.append(result.selection)
    label = result.attention + (f" ({', '.join(parts)})" if parts else "")
    return label + (" (quick)" if result.quick else "")


def superb_table(found: dict[tuple[str, str], SuperbResult]) -> Table:
    """Metric per upstream and task, speechattn variants before baselines; best in bold."""
    tasks = [t for t in COLUMNS if any(k[1] == t for k in found)]
    tasks += sorted({k[1] for k in found} - set(tasks))
    ours = sorted({row for (row, _), r in found.items() if r.upstream_ckpt})
    baselines = sorted({row for row, _ in found} - set(ours))
    value = {key: float(result.value) for key, result in found.items()}
    rows = [[row, "speechattn", *[value.get((row, t)) for t in tasks]] for row in ours]
    rows += [[row, "baseline", *[value.get((row, t)) for t in tasks]] for row in baselines]
    bold = set()
    for c, task in enumerate(tasks, start=2):
        higher = next(v for (_, t), v in found.items() if t == task).higher_is_better
        bold |= mark_best(rows, range(c, c + 1), max if higher else min)
    return Table(["upstream", "kind", *[COLUMNS.get(t, t) for t in tasks]], rows, bold)


# ----------------------------------------------------------------------------- spans
# The spans each head learns (Sukhbaatar et al. 2019, their Figure 3) for every adaptive_span
# upstream probed; with ALBERT sharing every depth shows the same layer.

VARIANT = "adaptive_span"


def span_table(results: ResultSet) -> Table | None:
    """Per (upstream, layer): each head's span in frames, their mean in ms; None if no upstream."""
    upstreams = [
        r.upstream
        for t in results.tasks()
        if (r := results.get(VARIANT, t)) is not None and Path(r.upstream).is_file()
    ]
    rows: list[list] = []
    heads = 0
    for path in dict.fromkeys(upstreams):  # each upstream once, in task order
        upstream = load_upstream(path)
        encoder = upstream.model.encoder
        for depth in range(encoder.num_layers):
            z = encoder.layers[encoder.depth_to_layer[depth]].attention.spans().detach().tolist()
            heads = max(heads, len(z))
            rows.append([path, depth + 1, *z, 1000 * sum(z) / len(z) / upstream.frame_rate])
    if not rows:
        return None
    # upstreams with fewer heads: gaps before their mean column
    rows = [r[:-1] + [None] * (heads + 3 - len(r)) + r[-1:] for r in rows]
    header = ["upstream", "layer", *[f"head {h}" for h in range(heads)], "mean (ms)"]
    return Table(header, rows, set())
