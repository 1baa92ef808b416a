"""Analysis job: head importance, ablation and pruning of a pretrained upstream (docs/analysis.md):
`heads` (objectives, analyses), `sources` (inputs, heads.json, `run`), `prune` (actual pruning)."""

from speechattn.tasks.analysis.heads import HeadsConfig, analyze_heads
from speechattn.tasks.analysis.sources import HeadsRunConfig, run

__all__ = ["HeadsConfig", "HeadsRunConfig", "analyze_heads", "run"]
