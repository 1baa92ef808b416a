"""Learned spans of `adaptive_span` upstreams, per layer and head (`spans.md`, `spans.csv`).

Sukhbaatar et al. (2019) show the spans each head learns (their Figure 3); this is the table
of it for every adaptive_span upstream a results folder probed. Reads the `upstream.pt` files
(through `speechattn.load_upstream`) and asks each depth's attention module for `spans()`;
with ALBERT sharing every depth shows the same (one) layer.
"""

from __future__ import annotations

from pathlib import Path

from speechattn.report.results import ResultSet
from speechattn.report.tables import Table

VARIANT = "adaptive_span"


def learned_spans(upstream_path: str | Path) -> tuple[list[list[float]], float]:
    """Spans z (frames) per depth and head of one upstream, and its frame rate (frames/s)."""
    from speechattn import load_upstream

    upstream = load_upstream(upstream_path)
    encoder = upstream.model.encoder
    spans = [
        encoder.layers[encoder.depth_to_layer[d]].attention.spans().detach().tolist()
        for d in range(encoder.num_layers)
    ]
    return spans, upstream.frame_rate


def span_table(results: ResultSet) -> Table | None:
    """One row per (upstream, layer): spans of each head in frames and their mean in ms.

    None when no adaptive_span result has its upstream file.
    """
    upstreams = []
    for task in results.tasks():
        result = results.get(VARIANT, task)
        if result is not None and Path(result.upstream).is_file():
            upstreams.append(result.upstream)
    rows: list[list] = []
    heads = 0
    for path in dict.fromkeys(upstreams):  # each upstream once, in task order
        spans, frame_rate = learned_spans(path)
        for depth, z in enumerate(spans, start=1):
            heads = max(heads, len(z))
            rows.append([path, depth, *z, 1000 * sum(z) / len(z) / frame_rate])
    if not rows:
        return None
    # upstreams with fewer heads: gaps before their mean column
    rows = [r[:-1] + [None] * (heads + 3 - len(r)) + r[-1:] for r in rows]
    header = ["upstream", "layer", *[f"head {h}" for h in range(heads)], "mean (ms)"]
    return Table(header, rows, set())


def spans_report(results: ResultSet, out: Path) -> list[Path]:
    """Write spans.md and spans.csv when the folder has an adaptive_span upstream."""
    table = span_table(results)
    if table is None:
        return []
    (out / "spans.md").write_text(
        "# Learned attention spans (adaptive_span)\n\n"
        "Span z of each head in model frames (the soft mask reaches z + R frames on each side); "
        "last column: the mean span in milliseconds.\n\n" + table.markdown(digits=1)
    )
    table.write_csv(out / "spans.csv")
    return [out / "spans.md", out / "spans.csv"]
