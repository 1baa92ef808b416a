"""ABX discriminability of frozen representations, without training (docs/abx.md).

- `score`: triphone items from frame-level phone labels and their frames at any frame rate,
  frame distances, DTW, triplet errors and their averaging (numba kernels)
- `run`: `AbxConfig`, `run(cfg)`, what `python -m speechattn.abx` does
"""

from speechattn.tasks.abx.run import AbxConfig, run
from speechattn.tasks.abx.score import AbxScore, Items, abx_score, frame_span, triphone_items

__all__ = ["AbxConfig", "AbxScore", "Items", "abx_score", "frame_span", "run", "triphone_items"]
