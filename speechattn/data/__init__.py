"""Data layer: the built-in eSpeak corpus, corpus readers (LibriSpeech + CPC labels, any audio
folder, lhotse manifests), the feature cache and the Lightning data modules (contracts in
docs/ARCHITECTURE.md).

    from speechattn.data import DataConfig, PretrainDataModule, LabelledDataModule
    dm = LabelledDataModule(DataConfig(batch_size=8))   # built-in corpus, built on first use
    dm.prepare_data(); dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))         # features (B, T, 80), phones (B, T), ...
"""

import importlib

from speechattn.data.config import DataConfig, default_cache_root
from speechattn.data.errors import DataError, Issues, Skip
from speechattn.data.features import (
    FeatureConfig,
    LogMel,
    Normalizer,
    expand_to_labels,
    num_frames,
    stack_frames,
)
from speechattn.data.librispeech import Utterance, find_splits, scan_split

# Imported on first use: Lightning is slow to import, and `python -m speechattn.data.synth`
# must not find its own module already imported by the package.
_LAZY = {
    "LabelledDataModule": "speechattn.data.datamodules",
    "PretrainDataModule": "speechattn.data.datamodules",
    "build_datamodule": "speechattn.data.datamodules",
    "resolve_root": "speechattn.data.datamodules",
    "build_corpus": "speechattn.data.synth",
    "ensure_embedded_corpus": "speechattn.data.synth",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speechattn.data' has no attribute {name!r}")


__all__ = [
    "DataConfig",
    "DataError",
    "FeatureConfig",
    "Issues",
    "LabelledDataModule",
    "LogMel",
    "Normalizer",
    "PretrainDataModule",
    "Skip",
    "Utterance",
    "build_corpus",
    "build_datamodule",
    "default_cache_root",
    "ensure_embedded_corpus",
    "expand_to_labels",
    "find_splits",
    "num_frames",
    "resolve_root",
    "scan_split",
    "stack_frames",
]
