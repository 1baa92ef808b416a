"""`python -m speechattn.analyze heads upstream=PATH [task=...] [downstream=RESULT_DIR] [overrides]`.

Head importance, single-head and keep-one ablations and the pruning curve (SPEC 5, Michel et
al. 2019) of a pretrained upstream, for any attention variant, on the pretraining loss or on a
trained downstream probe. Writes to the Hydra run dir (`outputs/analyze/heads/<time>`, or
`hydra.run.dir=DIR`):

    heads.json               importance, ablations, pruning curve and metadata
    heads_importance.png     normalised importance, depth x head
    heads_ablation.png       change of the metric per masked / kept head
    heads_pruning.png        metric vs fraction of heads pruned

All the work is in `run(cfg)`, which tests call directly (compose the config with
`compose_config`); `main` is the Hydra wrapper and the subcommand dispatch (`heads` is the only
analysis so far).

`task` is a config group: `task=speaker_utterance` (etc.) are the downstream entry point's
`conf/task/*.yaml`, and `task=pretrain` is `conf/analyze/task/pretrain.yaml`, which Hydra finds
through the search path entry `SEARCHPATH` that `main` and `compose_config` add.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from speechattn.config import CONFIG_DIR  # registers the structured configs
from speechattn.tasks.common import quiet_library_notices, run_output_dir

log = logging.getLogger("speechattn.analyze")
ANALYSES = ("heads",)
SEARCHPATH = f"file://{CONFIG_DIR / 'analyze'}"  # holds task/pretrain.yaml
USAGE = (
    "usage: python -m speechattn.analyze heads upstream=PATH "
    "[task=pretrain|speaker_utterance|speaker_frame|phone_1hidden|phone_2hidden] "
    "[downstream=RESULT_DIR] [overrides]"
)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """`conf/analyze.yaml` composed with `overrides`, as `python -m speechattn.analyze heads`
    would (for tests and notebooks)."""
    from speechattn.config import compose

    return compose("analyze", [f"hydra.searchpath=[{SEARCHPATH}]", *(overrides or [])])


def run_config(cfg: DictConfig) -> Any:
    """The typed `HeadsRunConfig` of a composed `conf/analyze.yaml`."""
    return OmegaConf.to_object(cfg)


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """Analyse the heads as configured; writes heads.json (+ figures) and returns its content
    plus `output_dir`, `heads_json` and `figures` (paths). `datamodule` replaces the data
    module built from the recorded data config (tests pass synthetic data)."""
    from speechattn.tasks.heads_sources import run_heads

    quiet_library_notices()
    config = run_config(cfg)
    out = run_output_dir(cfg).resolve()
    result, path = run_heads(config, out, datamodule)
    figures: list[Path] = []
    if cfg.get("figures", True):
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
def _heads_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (FileNotFoundError, ValueError) as e:  # bad inputs: one clear line, no traceback
        log.error("%s", e)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Dispatch `python -m speechattn.analyze <analysis> [overrides]` to the analysis."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE + "\n\nanalyses: " + ", ".join(ANALYSES), file=sys.stderr)
        sys.exit(0 if argv else 2)
    analysis = argv[0]
    if analysis not in ANALYSES:
        print(
            f"unknown analysis {analysis!r}; choose one of: {', '.join(ANALYSES)}\n{USAGE}",
            file=sys.stderr,
        )
        sys.exit(2)
    # Hydra parses the overrides; the search path makes task=pretrain an option of group `task`
    sys.argv = [sys.argv[0], f"hydra.searchpath=[{SEARCHPATH}]", *argv[1:]]
    _heads_main()


if __name__ == "__main__":
    main()
