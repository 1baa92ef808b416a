"""`python -m speechattn.export UPSTREAM_PT OUT_DIR [--license L] [--debug]`.

Writes the upstream `UPSTREAM_PT` as an upstream folder (docs/upstream.md): `config.json`,
`model.safetensors`, the model card `README.md` with its Hugging Face YAML header, and
`loss_curve.png` (from the `metrics.csv` beside the upstream, if any), written atomically,
ready to upload to the Hugging Face Hub (nothing is uploaded here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from speechattn.errors import add_debug_flag, command_line_errors
from speechattn.tasks.common import read_metrics
from speechattn.tasks.pretrain.model_card import CARD_FILE, write_upstream_folder

PROG = "python -m speechattn.export"
DEFAULT_LICENSE = "mit"  # pretraining's default (`license` in conf/pretrain.yaml)


def card_license(upstream: Path) -> str | None:
    """The license stated by the model card beside `upstream` (read with `yaml.safe_load`), or
    None (no card, no readable header)."""
    card = upstream.parent / CARD_FILE
    try:
        header = card.read_text(encoding="utf-8").split("---\n")[1]
        license = yaml.safe_load(header).get("license")
    except (OSError, UnicodeDecodeError, IndexError, AttributeError, yaml.YAMLError):
        return None
    return str(license) if license else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[2])
    parser.add_argument(
        "upstream", type=Path, help="an upstream.pt (python -m speechattn.pretrain)"
    )
    parser.add_argument("out", type=Path, help="the folder to write (replaced if it is one)")
    parser.add_argument(
        "--license",
        default=None,
        help=f"the card's license (default: the run's model card's, else {DEFAULT_LICENSE})",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with command_line_errors(args.debug, PROG):
        upstream = args.upstream.expanduser()
        rows = read_metrics(upstream.parent / "metrics.csv")
        license = args.license or card_license(upstream) or DEFAULT_LICENSE
        out = write_upstream_folder(upstream, args.out.expanduser(), rows, license)
    print(f"upstream folder written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
