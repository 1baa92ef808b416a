"""The SUPERB table: `superb_result.json` files (`python -m speechattn.superb -m evaluate`) under
a results folder, upstream (rows) x task (columns), speechattn variants beside the baselines.

A row is one upstream with one feature selection: a speechattn upstream by its attention
variant and the run folder of its `upstream.pt` (two runs of one variant, another seed or step
count, are two rows), or a baseline by its s3prl name (`fbank_no_cmvn`, the fair one: see
docs/superb.md); the selection is s3prl's weighted layer sum, or "layer N" (`-l N`); `--quick`
runs get their own rows, marked "(quick)", as their numbers are not comparable with full runs.
When one cell has several results (the same row and task evaluated again), the newest counts.
"""

from __future__ import annotations

from pathlib import Path

from speechattn.report.tables import Table, mark_best
from speechattn.tasks.records import SUPERB_FILE, WEIGHTED_SUM, SuperbResult, read_superb

# s3prl downstream -> column title
COLUMNS = {"speech_commands": "KS acc ↑", "voxceleb1": "SID acc ↑", "ctc": "PR PER ↓"}


def collect_superb(root: str | Path) -> tuple[dict[tuple[str, str], SuperbResult], list[str]]:
    """{(row, task): newest result} of every superb_result.json under `root`, and problems."""
    found: dict[tuple[str, str], SuperbResult] = {}
    problems = []
    for path in sorted(Path(root).rglob(SUPERB_FILE)):
        try:
            result = read_superb(path)
        except ValueError as e:
            problems.append(str(e))
            continue
        key = (row_label(result), result.task)
        if key not in found or result.created >= found[key].created:
            found[key] = result
    return found, problems


def row_label(result: SuperbResult) -> str:
    """'ldsa (run 2026-11-28_10-00-00, layer 3) (quick)': variant, upstream run folder,
    feature selection (unless the weighted sum), quick."""
    parts = []
    if result.upstream_ckpt:
        parts.append(f"run {Path(result.upstream_ckpt).parent.name}")
    if result.selection != WEIGHTED_SUM:
        parts.append(result.selection)
    label = result.attention + (f" ({', '.join(parts)})" if parts else "")
    return label + (" (quick)" if result.quick else "")


def has_superb_results(root: str | Path) -> bool:
    return next(Path(root).rglob(SUPERB_FILE), None) is not None


def superb_table(found: dict[tuple[str, str], SuperbResult]) -> Table:
    """Metric per upstream and task; speechattn variants first, then baselines; best per
    column (highest accuracy, lowest PER) in bold."""
    tasks = [t for t in COLUMNS if any(k[1] == t for k in found)]
    tasks += sorted({k[1] for k in found} - set(tasks))
    ours = sorted({row for (row, _), r in found.items() if r.upstream_ckpt})
    baselines = sorted({row for row, _ in found} - set(ours))
    value = {key: float(result.value) for key, result in found.items()}
    rows = []
    for row in [*ours, *baselines]:
        kind = "speechattn" if row in ours else "baseline"
        rows.append([row, kind, *[value.get((row, t)) for t in tasks]])
    bold = set()
    for c, task in enumerate(tasks, start=2):
        higher = next(v for (_, t), v in found.items() if t == task).higher_is_better
        bold |= mark_best(rows, range(c, c + 1), max if higher else min)
    return Table(["upstream", "kind", *[COLUMNS.get(t, t) for t in tasks]], rows, bold)


def superb_report(results_dir: str | Path, out: Path) -> tuple[list[Path], list[str], Table | None]:
    """Write superb.md / superb.csv when `results_dir` holds SUPERB results."""
    found, problems = collect_superb(results_dir)
    if not found:
        return [], problems, None
    table = superb_table(found)
    steps = sorted({r.steps for r in found.values()})
    (out / "superb.md").write_text(
        "# SUPERB through s3prl's run_downstream.py\n\n"
        "Test split, best dev checkpoint; s3prl's Featurizer (weighted layer sum) on the frozen "
        "upstream; best per column in **bold**; – = not run. Downstream training steps: "
        f"{', '.join(map(str, steps))}. (quick) rows used `--quick` and are not SUPERB scores.\n\n"
        + table.markdown()
    )
    table.write_csv(out / "superb.csv")
    return [out / "superb.md", out / "superb.csv"], problems, table
