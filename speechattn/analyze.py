"""`python -m speechattn.analyze heads upstream=PATH [task=...] [downstream=RESULT_DIR] [overrides]`.

Analyses of a pretrained upstream, one per option of the `analysis` config group; `heads`
gives head importance, single-head and keep-one ablations and the pruning curve (Michel et al.
2019; docs/analysis.md) on the pretraining loss or a trained downstream probe, as heads.json
and heads_*.png in the Hydra run dir. `run(cfg)` is `speechattn.tasks.analysis.run` with the
report's figures; `main` is the Hydra wrapper (every entry point has this shape).
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, compose, run_cli
from speechattn.tasks.analysis import run as run_analysis


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """`conf/analyze.yaml` with `overrides`, as `python -m speechattn.analyze heads` would."""
    return compose("analyze", ["analysis=heads", *(overrides or [])])


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """`speechattn.tasks.analysis.run` with the report's figures (tasks do not import report)."""
    from speechattn.report.figures import head_figures

    return run_analysis(cfg, datamodule, figures=head_figures)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="analyze")
def _main(cfg: DictConfig) -> Any:
    return run_cli(run, cfg)


def main(argv: list[str] | None = None) -> None:
    """`python -m speechattn.analyze heads ...` stands for `analysis=heads ...`."""
    args = sys.argv[1:] if argv is None else argv
    if args and "=" not in args[0] and not args[0].startswith("-"):
        args = [f"analysis={args[0]}", *args[1:]]
    sys.argv = [sys.argv[0], *args]
    _main()


if __name__ == "__main__":
    main()
