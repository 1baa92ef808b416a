"""`python -m speechattn.report RESULTS_DIR [--out DIR] [--bench PATH] [--maps-variant NAME]`.

Writes table1.md/.csv, table2.md/.csv (+ table2_reference.csv), fig_attention_maps.png,
fig_accuracy_vs_keys.png and README.md for the downstream results found under RESULTS_DIR.
Incomplete results show as gaps.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from speechattn.errors import MissingFileError, add_debug_flag, command_line_errors
from speechattn.report.build import make_report

PROG = "python -m speechattn.report"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[2])
    parser.add_argument("results_dir", help="folder searched recursively for result.json files")
    parser.add_argument("--out", help="where to write the report (default: RESULTS_DIR)")
    parser.add_argument(
        "--bench", help="attention benchmark JSON (default: RESULTS_DIR/bench/attention.json)"
    )
    parser.add_argument(
        "--maps-variant", default="full", help="variant whose attention maps to draw"
    )
    parser.add_argument("--maps-layer", type=int, help="1-based layer (default: last)")
    parser.add_argument(
        "--seq-len",
        type=int,
        help="frames at which keys attended are counted (default: median test utterance length)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with command_line_errors(args.debug, PROG):
        if not Path(args.results_dir).is_dir():
            raise MissingFileError(
                f"results folder {args.results_dir} does not exist; give the study's output "
                "folder (the one holding downstream/<variant>/<task>/result.json)"
            )
        report = make_report(
            args.results_dir, args.out, args.bench, args.maps_variant, args.maps_layer, args.seq_len
        )
    for path in report.files:
        print(f"wrote {path}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if report.missing:
        print(f"{len(report.missing)} (variant, task) runs missing: shown as gaps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
