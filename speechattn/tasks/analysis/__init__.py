"""Analysis job: head importance, ablation and pruning of a pretrained upstream (docs/analysis.md).

- `heads`: the objectives (pretraining loss, a trained probe) and the analyses over xi
- `sources`: where the model, probe and data come from; `HeadsRunConfig`; heads.json's content
"""

from speechattn.tasks.analysis.heads import HeadsConfig, analyze_heads
from speechattn.tasks.analysis.sources import HeadsRunConfig, run_heads

__all__ = ["HeadsConfig", "HeadsRunConfig", "analyze_heads", "run_heads"]
