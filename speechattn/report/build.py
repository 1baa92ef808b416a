"""Assemble the report of a results folder: tables, figures and a README tying them together."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from speechattn.errors import SpeechattnError
from speechattn.report.figures import (
    SPEAKER_TASK,
    abx_by_layer,
    accuracy_vs_keys,
    attention_maps,
    head_report,
)
from speechattn.report.results import (
    BenchRecord,
    ResultSet,
    collect,
    find_bench,
    read_bench,
    registry_order,
)
from speechattn.report.tables import (
    Table,
    abx_table,
    accuracy_table,
    collect_superb,
    cost_table,
    reference_table,
    span_table,
    superb_table,
)
from speechattn.tasks.records import EXAMPLE_FILE, MEL, TASKS

T = TypeVar("T")
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

    def write(self, name: str, text: str) -> None:
        (self.out / name).write_text(text)
        self.files.append(self.out / name)

    def write_table(self, stem: str, markdown: str, table: Table) -> None:
        """`<stem>.md` (the text) and `<stem>.csv` (`table`)."""
        self.write(f"{stem}.md", markdown)
        table.write_csv(self.out / f"{stem}.csv")
        self.files.append(self.out / f"{stem}.csv")


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
    superb = _superb(results_dir, report)
    if not variants and superb is not None:  # a SUPERB folder: its tables only
        report.write("README.md", _superb_readme(superb))
        return report
    expected = [MEL, *[v for v in registry_order() or variants if v != MEL]]
    report.missing = [(v, t) for v in expected for t in TASKS if results.get(v, t) is None]
    rows = list(dict.fromkeys([*expected, *variants]))
    table2 = accuracy_table(results, tasks, rows)
    reference = reference_table(list(TASKS), rows)
    report.write_table(
        "table2",
        "# Table 2: downstream test accuracy\n\n"
        "Test accuracy at the best dev checkpoint; best per column in **bold**; – = not run.\n\n"
        + table2.markdown()
        + "\n## Reference: the study on LibriSpeech (its Table 2)\n\n"
        "6-layer AALBERT, 500k pretraining steps on train-clean-360. Different corpus and scale:\n"
        "compare the ranking and the gaps to `mel`, not the absolute numbers.\n\n"
        + reference.markdown(),
        table2,
    )
    reference.write_csv(report.out / "table2_reference.csv")
    report.files.append(report.out / "table2_reference.csv")
    abx = abx_table(results) if results.abx else None
    if abx is not None:
        text = "# ABX error per layer\n\n" + ABX_NOTE + "\n\n" + abx.markdown(digits=2)
        report.write_table("abx", text, abx)
        report.files.append(abx_by_layer(results, report.out / "fig_abx_layers.png"))
    seq_len = seq_len or _typical_length(results)
    records: list[BenchRecord] = []
    bench_path = Path(bench) if bench is not None else find_bench(results_dir)
    bench_note = (
        "no attention benchmark found (run `python -m speechattn.bench attention --json PATH`)"
    )
    if bench_path is not None and bench_path.is_file():
        try:
            records, meta = read_bench(bench_path)
            bench_note = f"measured by `{bench_path}` on {meta.get('device', 'unknown device')}"
        except (OSError, ValueError) as e:
            bench_note = f"benchmark {bench_path} unreadable: {e}"
            report.notes.append(bench_note)
    elif bench is not None:
        report.notes.append(f"benchmark {bench} does not exist")
    table1 = cost_table(results, records, seq_len)  # every benchmarked length (CSV)
    table1_md = cost_table(results, records, seq_len, max_lengths=3)
    report.write_table(
        "table1",
        "# Table 1: cost per attention variant\n\n"
        f"Complexity and keys attended from the attention registry (T = {seq_len} frames); "
        f"attention parameters of one layer at the study's size; upstream parameters from the "
        f"results; time (forward + backward) and peak memory {bench_note}. Lowest measured cost "
        "per column in **bold**; every measured length is in table1.csv.\n\n"
        + table1_md.markdown(digits=1),
        table1,
    )
    fig = accuracy_vs_keys(results, seq_len, report.out / "fig_accuracy_vs_keys.png")
    if fig is None:
        report.notes.append("fig_accuracy_vs_keys.png: no speaker_utterance results yet")
    else:
        report.files.append(fig)
    _maps(results, maps_variant, maps_layer, report)
    # a broken heads.json or upstream must not sink the accuracy tables
    heads = _optional("head analyses", lambda: head_report(results_dir, report.out), report)
    report.files += heads or []
    spans = _optional("spans.md", lambda: span_table(results), report)
    if spans is not None:
        report.write_table(
            "spans",
            "# Learned attention spans (adaptive_span)\n\n"
            "Span z of each head in model frames (the soft mask reaches z + R frames on each "
            "side); last column: the mean span in milliseconds.\n\n" + spans.markdown(digits=1),
            spans,
        )
    report.write("README.md", _readme(report, results, table2, table1_md, superb, abx))
    return report


def _optional(what: str, build: Callable[[], T], report: Report) -> T | None:
    """What `build` returns, or None and a note when its input is broken."""
    try:
        return build()
    except SpeechattnError as e:
        report.notes.append(f"{what}: {type(e).__name__}: {e}")
        return None


def _superb(results_dir: Path, report: Report) -> Table | None:
    """superb.md / superb.csv when `results_dir` holds SUPERB results; their table."""
    found, problems = collect_superb(results_dir)
    report.notes += problems
    if not found:
        return None
    table = superb_table(found)
    steps = ", ".join(map(str, sorted({r.steps for r in found.values()})))
    report.write_table(
        "superb",
        "# SUPERB through s3prl's run_downstream.py\n\n"
        "Test split, best dev checkpoint; s3prl's Featurizer (weighted layer sum) on the frozen "
        "upstream; best per column in **bold**; – = not run. Downstream training steps: "
        f"{steps}. (quick) rows used `--quick` and are not SUPERB scores.\n\n" + table.markdown(),
        table,
    )
    return table


def _typical_length(results: ResultSet) -> int:
    """Median upstream frames per test utterance over the pretrained runs (default 500)."""
    lengths = [
        r.frames_per_utterance
        for runs in results.results.values()
        for _, r in runs.values()
        if r.attention != MEL and r.frames_per_utterance > 0
    ]
    return int(round(statistics.median(lengths))) if lengths else DEFAULT_SEQ_LEN


def _maps(results: ResultSet, variant: str, layer: int | None, report: Report) -> None:
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
            chosen = layer or max(int(result.model_config.get("num_layers", 0) or 0), 1)
            try:
                fig = attention_maps(
                    result.upstream, example, report.out / "fig_attention_maps.png", chosen
                )
                report.files.append(fig)
                return
            except SpeechattnError as e:  # a broken upstream must not sink the whole report
                report.notes.append(f"fig_attention_maps.png: {name}: {type(e).__name__}: {e}")
                break
    report.notes.append(
        "fig_attention_maps.png: no pretrained run with its upstream.pt and example utterance"
    )


def _superb_readme(superb: Table) -> str:
    return "\n".join(
        [
            "# SUPERB results",
            "",
            "`superb_result.json` files under this folder (`python -m speechattn.superb -m evaluate`); "
            "regenerate with `python -m speechattn.report RESULTS_DIR`. Every file: "
            "[superb.md](superb.md) / `superb.csv`.",
            "",
            superb.markdown(),
        ]
    )


def _readme(
    report: Report,
    results: ResultSet,
    table2: Table,
    table1: Table,
    superb: Table | None,
    abx: Table | None,
) -> str:
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
        (
            written("fig_attention_maps.png"),
            "| [fig_attention_maps.png](fig_attention_maps.png) "
            "| every head of one layer for one test utterance under its log-mel spectrogram (study "
            "Fig. 2) |",
        ),
        (
            written("fig_accuracy_vs_keys.png"),
            "| [fig_accuracy_vs_keys.png](fig_accuracy_vs_keys"
            ".png) | utterance-level speaker accuracy vs keys attended per query (study Fig. 4) |",
        ),
        (
            written("heads.md"),
            "| [heads.md](heads.md), `heads_*.png`, `fig_heads_pruning.png` | "
            "head importance heat-maps, single-head ablations and pruning curves (`python -m "
            "speechattn.analyze heads`) |",
        ),
        (
            abx is not None,
            "| [abx.md](abx.md) / `abx.csv`, [fig_abx_layers.png](fig_abx_layers"
            ".png) | ABX error per variant and layer, within and across speakers (`python -m "
            "speechattn.abx`) |",
        ),
        (
            superb is not None,
            "| [superb.md](superb.md) / `superb.csv` | SUPERB tasks through "
            "s3prl's runner: speechattn upstreams vs baselines (`python -m speechattn.superb`) |",
        ),
        (
            written("spans.md"),
            "| [spans.md](spans.md) / `spans.csv` | learned attention span of "
            "every head and layer of the adaptive_span upstreams |",
        ),
    ]
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
        lines += [f"## {SPEAKER_TASK} accuracy vs keys attended", ""]
        lines += ["![accuracy vs keys](fig_accuracy_vs_keys.png)", ""]
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(lines)
