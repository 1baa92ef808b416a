"""Analysis job: head importance, ablation and pruning of a pretrained upstream (docs/analysis.md).

- `heads`: the objectives (pretraining loss, a trained probe) and the analyses over xi
- `sources`: where the model, probe and data come from; `HeadsRunConfig`; heads.json's content;
  `run(cfg)`, what `python -m speechattn.analyze heads` does (the figures aside)
- `prune`: `PruneConfig` and `run(cfg)` of `python -m speechattn.prune`
"""

from speechattn.tasks.analysis.heads import HeadsConfig, analyze_heads
from speechattn.tasks.analysis.sources import HeadsRunConfig, run

__all__ = ["HeadsConfig", "HeadsRunConfig", "analyze_heads", "run"]
