"""Table 1 (cost per variant), Table 2 (accuracy per variant x task) and the ABX error rates
per variant x layer, as Markdown and CSV.

Missing entries are gaps (`–` in Markdown, empty in CSV), never errors.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechattn.report.reference import REFERENCE, reference_accuracy
from speechattn.report.results import BenchRecord, ResultSet, registry_order
from speechattn.tasks.records import MEL

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


@dataclass
class Table:
    """Header + rows of cells (None = gap) + optional per-cell emphasis."""

    header: list[str]
    rows: list[list[Any]]
    bold: set[tuple[int, int]]

    def markdown(self, digits: int = 4) -> str:
        def cell(value: Any, r: int, c: int) -> str:
            if value is None:
                text = GAP
            elif isinstance(value, float):
                text = f"{value:.{digits}f}"
            else:
                text = str(value)
            return f"**{text}**" if (r, c) in self.bold and value is not None else text

        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        for r, row in enumerate(self.rows):
            lines.append("| " + " | ".join(cell(v, r, c) for c, v in enumerate(row)) + " |")
        return "\n".join(lines) + "\n"

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.header)
            for row in self.rows:
                writer.writerow(["" if v is None else v for v in row])


def mark_best(rows: list[list[Any]], columns: range, best: Any = max) -> set[tuple[int, int]]:
    """(row, column) of the maximum (`best=min`: minimum) of each column (ties all marked)."""
    bold = set()
    for c in columns:
        values = [row[c] for row in rows if isinstance(row[c], float)]
        if not values:
            continue
        top = best(values)
        bold |= {(r, c) for r, row in enumerate(rows) if row[c] == top}
    return bold


def accuracy_table(results: ResultSet, tasks: list[str], variants: list[str]) -> Table:
    """Test accuracy per variant (rows) and task (columns); best per column in bold. A row
    that is the same model as an earlier one (`same_models`) says so."""
    options = {v: _trained_options(results, v) for v in variants}
    same = same_models(variants, options)
    header = ["variant", *[TASK_TITLES.get(t, t) for t in tasks]]
    rows = [[_label(v, same), *[results.accuracy(v, t) for t in tasks]] for v in variants]
    return Table(header, rows, mark_best(rows, range(1, len(header))))


def _trained_options(results: ResultSet, variant: str) -> dict[str, Any]:
    """The attention options the variant's upstream was pretrained with (from its results)."""
    found = (results.get(variant, t) for t in results.tasks())
    config = next((r.model_config for r in found if r is not None and r.model_config), {})
    return config.get("attention_options") or {}


def same_models(
    variants: list[str], options: dict[str, dict[str, Any]] | None = None
) -> dict[str, str]:
    """Rows that are mathematically the same model as an earlier row, mapped to that row:
    LSH schemes whose codes give equal match counts under the chosen hashes
    (`attention.lsh.same_model`), with `options` (default: the registry's). Each is built with
    one head of the study's head size: every head hashes with the layer's one projection, so
    one head decides, at a twelfth of the cost."""
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
    """ABX error rates in % per variant (rows) and layer, within and across speakers
    (columns); lowest per column in bold."""
    found = results.abx_variants()
    layers = sorted({k for v in found for k in results.abx[v][1].errors("within")})
    header = ["variant", *[f"L{k} {mode}" for k in layers for mode in ("within", "across")]]
    rows = []
    for v in found:
        record = results.abx[v][1]
        errors = {mode: record.errors(mode) for mode in ("within", "across")}
        cells = [errors[mode].get(k) for k in layers for mode in ("within", "across")]
        rows.append([_label(v, {}), *[None if e is None else 100 * e for e in cells]])
    return Table(header, rows, mark_best(rows, range(1, len(header)), best=min))


def reference_table(tasks: list[str], variants: list[str]) -> Table:
    """The study's LibriSpeech accuracies (its Table 2) for the same rows, best per column in bold."""
    names = [v for v in variants if v in REFERENCE] + [v for v in REFERENCE if v not in variants]
    header = ["variant", *[TASK_TITLES.get(t, t) for t in tasks]]
    rows = [[_label(v, {}), *[reference_accuracy(v, t) for t in tasks]] for v in names]
    return Table(header, rows, mark_best(rows, range(1, len(header))))


def _label(variant: str, same: dict[str, str]) -> str:
    if variant == MEL:
        return "mel (no pretraining)"
    return f"{variant} (same model as {same[variant]})" if variant in same else variant


# ----------------------------------------------------------------------------- table 1


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
    results: ResultSet,
    bench: list[BenchRecord],
    seq_len: int,
    variants: list[str] | None = None,
    max_lengths: int | None = None,
) -> Table:
    """Per variant: complexity, keys attended at `seq_len`, parameters, measured time/memory.

    Measured columns come from the benchmark records, one pair per benchmarked length (at most
    `max_lengths`, spread from the shortest to the longest); absent without a benchmark.
    """
    if variants is None:
        names = registry_order() or [v for v in results.variants() if v != MEL]
        variants = names + [
            v
            for v in results.variants() + sorted({r.variant for r in bench})
            if v not in names and v != MEL
        ]
    lengths = sorted({r.seq_len for r in bench})
    if max_lengths is not None and len(lengths) > max_lengths:  # smallest, ..., largest
        step = (len(lengths) - 1) / (max_lengths - 1)
        lengths = sorted({lengths[round(i * step)] for i in range(max_lengths)})
    by_key = {(r.variant, r.seq_len): r for r in bench}
    same = same_models(variants)
    header = [
        "variant",
        "time complexity (training)",
        "time complexity (inference)",
        f"keys attended (T={seq_len})",
        f"attention params/layer (D={STUDY_DIM}, h={STUDY_HEADS})",
        "upstream params",
    ]
    header += [f"time ms (T={n})" for n in lengths] + [f"peak MiB (T={n})" for n in lengths]
    rows = []
    for v in variants:
        facts = attention_facts(v, seq_len)
        upstream_params = next(
            (r.upstream_parameters for t in results.tasks() if (r := results.get(v, t))), None
        )
        row: list[Any] = [
            _label(v, same),
            facts.get("complexity_training"),
            facts.get("complexity_inference"),
            facts.get("keys_attended"),
            facts.get("attention_params"),
            upstream_params or None,
        ]
        row += [getattr(by_key.get((v, n)), "time_ms", None) for n in lengths]
        row += [getattr(by_key.get((v, n)), "memory_mb", None) for n in lengths]
        rows.append(row)
    return Table(header, rows, mark_best(rows, range(6, len(header)), best=min))  # lowest cost
