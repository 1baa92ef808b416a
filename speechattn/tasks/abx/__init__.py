"""ABX discriminability of frozen representations, without training (docs/abx.md): `score`
(items, distances, DTW, triplets, averaging) and `run` (`python -m speechattn.abx`)."""

from speechattn.tasks.abx.run import AbxConfig, run
from speechattn.tasks.abx.score import AbxScore, Items, abx_score, frame_span, triphone_items

__all__ = ["AbxConfig", "AbxScore", "Items", "abx_score", "frame_span", "run", "triphone_items"]
