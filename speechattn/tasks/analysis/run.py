"""`run(cfg)`: the head analysis job (`python -m speechattn.analyze heads`) as configured.

The shape every job's run has: resolve the inputs, analyse, write the record. The figures are
the report layer's (`speechattn.report.heads.head_figures`), which tasks do not import: the
entry point passes it as `figures`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from speechattn.tasks.analysis.sources import HeadsRunConfig, run_heads
from speechattn.tasks.common import quiet_library_notices, run_output_dir
from speechattn.tasks.records import HeadsRecord

log = logging.getLogger("speechattn.analyze")

FigureWriter = Callable[[HeadsRecord, Path], list[Path]]  # (heads.json content, folder) -> PNGs


def run(
    cfg: DictConfig, datamodule: Any = None, figures: FigureWriter | None = None
) -> dict[str, Any]:
    """Analyse the heads as configured; writes heads.json (+ the figures of `figures`, when
    `cfg.figures`) and returns its content plus `output_dir`, `heads_json` and `figures`
    (paths). `datamodule` replaces the data module built from the recorded data config (tests
    pass synthetic data)."""
    quiet_library_notices()
    config: HeadsRunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    out = run_output_dir(cfg).resolve()
    result, path = run_heads(config, out, datamodule)
    drawn = figures(result, out) if config.figures and figures is not None else []
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
        "figures": [str(p) for p in drawn],
    }
