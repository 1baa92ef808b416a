"""AALBERT, its objective (masked acoustic modelling) and optimiser, and the upstream files.

from speechattn.model import aalbert_tiny, load_upstream
model = aalbert_tiny(attention="ldsa")           # ModelConfig + registry attention
hidden = model(features, lengths)                # L+1 hidden states (B, T', D)
upstream = load_upstream("outputs/.../upstream.pt")
prune_upstream("upstream.pt", head_mask, "pruned.pt")  # remove masked heads' parameters
"""

from speechattn.model.aalbert import (
    AALBERT,
    PRESETS,
    ModelConfig,
    aalbert,
    aalbert_base,
    aalbert_tiny,
)
from speechattn.model.masking import (
    MaskedBatch,
    MaskingConfig,
    corrupt,
    mask_frames,
    masked_l1,
    reconstruction_loss,
)
from speechattn.model.optim import OptimConfig, build_optimizer, build_scheduler, parameter_groups
from speechattn.model.pruning import prune_upstream
from speechattn.model.upstream import Upstream, UpstreamFileError, UpstreamOutput, load_upstream

__all__ = [
    "AALBERT",
    "PRESETS",
    "MaskedBatch",
    "MaskingConfig",
    "ModelConfig",
    "OptimConfig",
    "Upstream",
    "UpstreamFileError",
    "UpstreamOutput",
    "aalbert",
    "aalbert_base",
    "aalbert_tiny",
    "build_optimizer",
    "build_scheduler",
    "corrupt",
    "load_upstream",
    "mask_frames",
    "masked_l1",
    "parameter_groups",
    "prune_upstream",
    "reconstruction_loss",
]
