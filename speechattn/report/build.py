"""Assemble the report of a results folder: tables, figures and a README tying them together.

Reads files only: `result.json` files, the attention benchmark JSON and, for the attention maps,
one `upstream.pt` (through `speechattn.load_upstream`) with the utterance saved beside a result.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from speechattn.errors import SpeechattnError
from speechattn.report.figures import SPEAKER_TASK, abx_by_layer, accuracy_vs_keys, attention_maps
from speechattn.report.heads import head_report
from speechattn.report.results import (
    BenchRecord,
    ResultSet,
    collect,
    find_bench,
    read_bench,
    registry_order,
)
from speechattn.report.spans import spans_report
from speechattn.report.superb import has_superb_results, superb_report
from speechattn.report.tables import Table, abx_table, accuracy_table, cost_table, reference_table
from speechattn.tasks.records import EXAMPLE_FILE, MEL, TASKS

log = logging.getLogger(__name__)
DEFAULT_SEQ_LEN = 500  # ~15 s at 30 ms per frame: a typical LibriSpeech utterance
ABX_NOTE = (
    "Triphone ABX error in % (lower is better; 50 = chance) of each layer's frozen features, "
    "within and across speakers (`python -m speechattn.abx`, docs/abx.md); lowest per column "
    "in **bold**; layer 0 is the input embedding, `mel` the log-mel features."
)


@dataclass
class Report:
    """What was written and what is missing."""

    out: Path
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)  # (variant, task)


def make_report(
    results_dir: str | Path,
    out: str | Path | None = None,
    bench: str | Path | None = None,
    maps_variant: str = "full",
    maps_layer: int | None = None,
    seq_len: int | None = None,
) -> Report:
    """Write table1/table2 (.md, .csv), the two figures and README.md; never fails on gaps."""
    results_dir = Path(results_dir)
    report = Report(Path(out) if out is not None else results_dir)
    report.out.mkdir(parents=True, exist_ok=True)
    results = collect(results_dir)
    report.notes += results.problems
    variants, tasks = results.variants(), results.tasks()
    if not variants and has_superb_results(results_dir):  # a SUPERB folder: its tables only
        files, problems, superb = superb_report(results_dir, report.out)
        report.files += files
        report.notes += problems
        (report.out / "README.md").write_text(_superb_readme(superb))
        report.files.append(report.out / "README.md")
        return report
    expected = [MEL, *[v for v in registry_order() or variants if v != MEL]]
    report.missing = [(v, t) for v in expected for t in TASKS if results.get(v, t) is None]
    rows = list(dict.fromkeys([*expected, *variants]))

    # Table 2: accuracy, with the study's LibriSpeech numbers for comparison.
    table2 = accuracy_table(results, tasks, rows)
    reference = reference_table(list(TASKS), rows)
    (report.out / "table2.md").write_text(
        "# Table 2: downstream test accuracy\n\n"
        "Test accuracy at the best dev checkpoint; best per column in **bold**; – = not run.\n\n"
        + table2.markdown()
        + "\n## Reference: the study on LibriSpeech (its Table 2)\n\n"
        "6-layer AALBERT, 500k pretraining steps on train-clean-360. Different corpus and scale:\n"
        "compare the ranking and the gaps to `mel`, not the absolute numbers.\n\n"
        + reference.markdown()
    )
    table2.write_csv(report.out / "table2.csv")
    reference.write_csv(report.out / "table2_reference.csv")
    report.files += [report.out / n for n in ("table2.md", "table2.csv", "table2_reference.csv")]

    # ABX error per layer, beside the probes' accuracy.
    abx = abx_table(results) if results.abx else None
    if abx is not None:
        (report.out / "abx.md").write_text(
            "# ABX error per layer\n\n" + ABX_NOTE + "\n\n" + abx.markdown(digits=2)
        )
        abx.write_csv(report.out / "abx.csv")
        report.files += [report.out / "abx.md", report.out / "abx.csv"]
        report.files.append(abx_by_layer(results, report.out / "fig_abx_layers.png"))

    # Table 1: cost.
    seq_len = seq_len or _typical_length(results)
    records: list[BenchRecord] = []
    bench_path = Path(bench) if bench is not None else find_bench(results_dir)
    bench_note = (
        "no attention benchmark found (run `python -m speechattn.bench attention --json PATH`)"
    )
    if bench_path is not None and bench_path.is_file():
        try:
            records, meta = read_bench(bench_path)
            device = meta.get("device", "unknown device")
            bench_note = f"measured by `{bench_path}` on {device}"
        except (OSError, ValueError) as e:
            bench_note = f"benchmark {bench_path} unreadable: {e}"
            report.notes.append(bench_note)
    elif bench is not None:
        report.notes.append(f"benchmark {bench} does not exist")
    table1 = cost_table(results, records, seq_len)  # every benchmarked length (CSV)
    table1_md = cost_table(results, records, seq_len, max_lengths=3)
    (report.out / "table1.md").write_text(
        "# Table 1: cost per attention variant\n\n"
        f"Complexity and keys attended from the attention registry (T = {seq_len} frames); "
        f"attention parameters of one layer at the study's size; upstream parameters from the "
        f"results; time (forward + backward) and peak memory {bench_note}. Lowest measured cost "
        "per column in **bold**; every measured length is in table1.csv.\n\n"
        + table1_md.markdown(digits=1)
    )
    table1.write_csv(report.out / "table1.csv")
    report.files += [report.out / "table1.md", report.out / "table1.csv"]

    # Figures.
    fig = accuracy_vs_keys(results, seq_len, report.out / "fig_accuracy_vs_keys.png")
    if fig is None:
        report.notes.append("fig_accuracy_vs_keys.png: no speaker_utterance results yet")
    else:
        report.files.append(fig)
    fig = _maps(results, maps_variant, maps_layer, report)
    if fig is not None:
        report.files.append(fig)
    # a broken heads.json or upstream must not sink the accuracy tables
    report.files += _optional("head analyses", lambda: head_report(results_dir, report.out), report)
    report.files += _optional("spans.md", lambda: spans_report(results, report.out), report)
    superb_files, problems, superb = superb_report(results_dir, report.out)
    report.files += superb_files
    report.notes += problems

    (report.out / "README.md").write_text(
        _readme(report, results, tables=(table2, table1_md), superb=superb, abx=abx)
    )
    report.files.append(report.out / "README.md")
    return report


def _optional(what: str, write: Callable[[], list[Path]], report: Report) -> list[Path]:
    """The files `write` writes, or none and a note when its input is broken."""
    try:
        return write()
    except SpeechattnError as e:
        report.notes.append(f"{what}: {type(e).__name__}: {e}")
        return []


def _typical_length(results: ResultSet) -> int:
    """Median upstream frames per test utterance over the pretrained runs (default 500)."""
    lengths = [
        r.frames_per_utterance
        for runs in results.results.values()
        for _, r in runs.values()
        if r.attention != MEL and r.frames_per_utterance > 0
    ]
    return int(round(statistics.median(lengths))) if lengths else DEFAULT_SEQ_LEN


def _maps(results: ResultSet, variant: str, layer: int | None, report: Report) -> Path | None:
    """Attention maps of `variant` (fallback: any pretrained variant with an upstream file)."""
    candidates = [variant] + [v for v in results.variants() if v not in (variant, MEL)]
    for name in candidates:
        for task in results.tasks():
            result, path = results.get(name, task), results.path(name, task)
            if result is None or path is None or result.upstream == MEL:
                continue
            example = path.parent / EXAMPLE_FILE
            if not Path(result.upstream).is_file() or not example.is_file():
                continue
            num_layers = int(result.model_config.get("num_layers", 0) or 0)
            chosen = layer or max(num_layers, 1)
            try:
                return attention_maps(
                    result.upstream, example, report.out / "fig_attention_maps.png", chosen
                )
            except SpeechattnError as e:  # a broken upstream must not sink the whole report
                report.notes.append(f"fig_attention_maps.png: {name}: {type(e).__name__}: {e}")
                break
    report.notes.append(
        "fig_attention_maps.png: no pretrained run with its upstream.pt and example utterance"
    )
    return None


def _superb_readme(superb: Table) -> str:
    return "\n".join([
        "# SUPERB results", "",
        "`superb_result.json` files under this folder (`python -m speechattn.superb -m evaluate`); "
        "regenerate with `python -m speechattn.report RESULTS_DIR`. Every file: "
        "[superb.md](superb.md) / `superb.csv`.", "",
        superb.markdown(),
    ])  # fmt: skip


def _readme(
    report: Report,
    results: ResultSet,
    tables: tuple,
    superb: Table | None = None,
    abx: Table | None = None,
) -> str:
    table2, table1 = tables

    def written(name: str) -> bool:
        return (report.out / name).is_file()

    found = sum(len(runs) for runs in results.results.values())
    lines = [
        "# Attention study: results",
        "",
        f"{found} downstream runs from `result.json` files under this folder "
        f"({len(results.variants())} upstreams incl. `mel`). Regenerate with "
        "`python -m speechattn.report RESULTS_DIR`.",
        "",
        "| file | content |",
        "|---|---|",
        "| [table2.md](table2.md) / `table2.csv` | test accuracy per variant × task, mel baseline, "
        "best per column in bold; the study's LibriSpeech numbers below it "
        "(`table2_reference.csv`) |",
        "| [table1.md](table1.md) / `table1.csv` | complexity, keys attended, parameters, measured "
        "time and peak memory per variant |",
    ]
    optional_rows = [  # (present, the row)
        (written("fig_attention_maps.png"), "| [fig_attention_maps.png](fig_attention_maps.png) "
         "| every head of one layer for one test utterance under its log-mel spectrogram (study "
         "Fig. 2) |"),
        (written("fig_accuracy_vs_keys.png"), "| [fig_accuracy_vs_keys.png](fig_accuracy_vs_keys"
         ".png) | utterance-level speaker accuracy vs keys attended per query (study Fig. 4) |"),
        (written("heads.md"), "| [heads.md](heads.md), `heads_*.png`, `fig_heads_pruning.png` | "
         "head importance heat-maps, single-head ablations and pruning curves (`python -m "
         "speechattn.analyze heads`) |"),
        (abx is not None, "| [abx.md](abx.md) / `abx.csv`, [fig_abx_layers.png](fig_abx_layers"
         ".png) | ABX error per variant and layer, within and across speakers (`python -m "
         "speechattn.abx`) |"),
        (superb is not None, "| [superb.md](superb.md) / `superb.csv` | SUPERB tasks through "
         "s3prl's runner: speechattn upstreams vs baselines (`python -m speechattn.superb`) |"),
        (written("spans.md"), "| [spans.md](spans.md) / `spans.csv` | learned attention span of "
         "every head and layer of the adaptive_span upstreams |"),
    ]  # fmt: skip
    lines += [row for present, row in optional_rows if present]
    lines += ["", "## Accuracy (Table 2)", "", table2.markdown()]
    if report.missing:
        shown = ", ".join(f"{v}/{t}" for v, t in report.missing[:20])
        more = f" and {len(report.missing) - 20} more" if len(report.missing) > 20 else ""
        lines += [f"Missing runs ({len(report.missing)}): {shown}{more}.", ""]
    if abx is not None:
        lines += ["## ABX error per layer", "", ABX_NOTE, "", abx.markdown(digits=2)]
        lines += ["![ABX per layer](fig_abx_layers.png)", ""]
    if superb is not None:
        lines += ["## SUPERB ([superb.md](superb.md))", "", superb.markdown()]
    lines += ["## Cost (Table 1)", "", table1.markdown(digits=1)]
    if written("fig_attention_maps.png"):
        lines += ["## Attention maps", "", "![attention maps](fig_attention_maps.png)", ""]
    if written("fig_accuracy_vs_keys.png"):
        lines += [
            f"## {SPEAKER_TASK} accuracy vs keys attended",
            "",
            "![accuracy vs keys](fig_accuracy_vs_keys.png)",
            "",
        ]
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(lines)
