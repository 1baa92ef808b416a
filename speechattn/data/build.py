"""`build_datamodule`: a job's data module from its `data` config (the one place that knows
both kinds, so that neither data module imports the other's file)."""

from __future__ import annotations

from typing import Any

import lightning as L

from speechattn.data.config import DataConfig
from speechattn.data.datamodules import PretrainDataModule
from speechattn.data.labelled import LabelledDataModule
from speechattn.utils import plain


def build_datamodule(config: Any, kind: str = "pretrain") -> L.LightningDataModule:
    """The data module of a job from its `data` config (a DataConfig, dict or config node):
    `PretrainDataModule` (kind "pretrain") or `LabelledDataModule` (kind "labelled"). A
    `_target_` instantiates any other DataModule that follows the batch contract of
    docs/ARCHITECTURE.md instead (bring your own data; the tests use synthetic speech)."""
    if not isinstance(config, DataConfig) and "_target_" in config:
        from hydra.utils import instantiate

        return instantiate(config)
    if kind not in ("pretrain", "labelled"):
        raise ValueError(f"kind must be pretrain or labelled, not {kind!r}")
    if not isinstance(config, DataConfig):
        config = DataConfig(**plain(config))
    return PretrainDataModule(config) if kind == "pretrain" else LabelledDataModule(config)
