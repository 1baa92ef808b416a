"""`python -m speechattn.analyze heads upstream=PATH [task=...] [downstream=RESULT_DIR] [overrides]`.

Analyses of a pretrained upstream, one per option of the `analysis` config group; `heads`
(`analysis=heads`, the only one so far) gives head importance, single-head and keep-one
ablations and the pruning curve (Michel et al. 2019; docs/analysis.md), for any attention variant, on the
pretraining loss or on a trained downstream probe. Writes to the Hydra run dir
(`outputs/analyze/heads/<time>`, or `hydra.run.dir=DIR`):

    heads.json               importance, ablations, pruning curve and metadata
    heads_importance.png     normalised importance, depth x head
    heads_ablation.png       change of the metric per masked / kept head
    heads_pruning.png        metric vs fraction of heads pruned

`run(cfg)` (tests call it; `compose_config` composes its config) is the analysis job,
`speechattn.tasks.analysis.run_heads`, plus the report's figures; `main` is the Hydra wrapper
(every entry point has this shape).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from speechattn.config import CONFIG_DIR, compose, run_cli
from speechattn.tasks.analysis import HeadsRunConfig, run_heads
from speechattn.tasks.common import quiet_library_notices, run_output_dir

log = logging.getLogger("speechattn.analyze")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """`conf/analyze.yaml` with `overrides`, as `python -m speechattn.analyze heads` would."""
    return compose("analyze", ["analysis=heads", *(overrides or [])])


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """Analyse the heads as configured; writes heads.json (+ figures) and returns its content
    plus `output_dir`, `heads_json` and `figures` (paths). `datamodule` replaces the data
    module built from the recorded data config (tests pass synthetic data)."""
    quiet_library_notices()
    config: HeadsRunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    out = run_output_dir(cfg).resolve()
    result, path = run_heads(config, out, datamodule)
    figures: list[Path] = []
    if config.figures:
        from speechattn.report.heads import head_figures

        figures = head_figures(result, out)
    log.info(
        "heads: %s on %s, base %s %.4f -> %s",
        result["task"],
        result["attention"],
        result["metric"],
        result["base_metric"],
        path,
    )
    print(f"heads.json written to {path}", flush=True)
    return {
        **result,
        "output_dir": str(out),
        "heads_json": str(path),
        "figures": [str(p) for p in figures],
    }


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="analyze")
def _main(cfg: DictConfig) -> Any:
    return run_cli(run, cfg, errors=(FileNotFoundError, ValueError))


def main(argv: list[str] | None = None) -> None:
    """The analysis is a config group; `python -m speechattn.analyze heads ...`, the documented
    form, names it first and stands for `analysis=heads ...`."""
    args = sys.argv[1:] if argv is None else argv
    if args and "=" not in args[0] and not args[0].startswith("-"):
        args = [f"analysis={args[0]}", *args[1:]]
    sys.argv = [sys.argv[0], *args]
    _main()


if __name__ == "__main__":
    main()
