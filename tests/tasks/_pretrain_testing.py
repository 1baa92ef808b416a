"""Helpers for the task tests: a composed pretraining config and synthetic speech-like data
(a module of its own name, not a conftest, so that it imports the same in any test order)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, open_dict
from torch.utils.data import DataLoader, Dataset

from speechattn.config import compose
from speechattn.data.features import Normalizer


def compose_pretrain(output_dir: Path, *overrides: str, shrink: bool = True) -> DictConfig:
    """The real `conf/pretrain.yaml`, shrunk for CPU tests (tiny model, no progress bar)."""
    base = [
        "model.net.dim=32",
        "model.net.num_layers=2",
        "model.net.num_heads=2",
        "model.net.ffn_dim=64",
        "model.optimizer.lr=1e-2",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=2",
        "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=4",
        "checkpoint.keep=-1",
        "progress_bar=none",
        "logger=none",
    ]
    cfg = compose("pretrain", [*(base if shrink else []), *overrides])
    with open_dict(cfg):
        cfg.output_dir = str(output_dir)
    return cfg


class SyntheticSpeech(Dataset):
    """Utterances of smooth, speaker-coloured "log-mel" (B, T, F): learnable from context.

    Each utterance is a per-speaker spectral envelope plus a few slow sinusoids over time,
    so masked spans are predictable from their neighbours and the loss can fall quickly.
    """

    def __init__(
        self,
        n: int,
        feature_dim: int = 16,
        seed: int = 0,
        min_len: int = 60,
        max_len: int = 240,
        short_every: int = 0,
    ) -> None:
        # a spectral shape shared by every split (learnable within a few steps) + speaker colour
        g = torch.Generator().manual_seed(1234)
        envelopes = 1.5 * torch.randn(feature_dim, generator=g)
        envelopes = envelopes + 0.5 * torch.randn(4, feature_dim, generator=g)  # (4, F)
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            T = int(torch.randint(min_len, max_len + 1, (), generator=g))
            if short_every and i % short_every == short_every - 1:
                T = 1 + i % 4  # a few utterances shorter than one masking span
            t = torch.arange(T, dtype=torch.float32)[:, None]
            freq = torch.rand(3, generator=g) * 0.3 + 0.05
            phase = torch.rand(3, generator=g) * 6.28
            mix = torch.randn(3, feature_dim, generator=g)
            x = envelopes[i % 4] + 0.3 * torch.sin(t * freq + phase) @ mix  # (T, F)
            x = x + 0.05 * torch.randn(T, feature_dim, generator=g)
            self.items.append((f"utt{i:04d}", x))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def collate(items) -> dict:
    lengths = torch.tensor([x.shape[0] for _, x in items])
    T = int(lengths.max())
    F = items[0][1].shape[1]
    features = torch.zeros(len(items), T, F)
    for b, (_, x) in enumerate(items):
        features[b, : x.shape[0]] = x
    return {
        "features": features,
        "lengths": lengths,
        "padding_mask": torch.arange(T)[None, :] >= lengths[:, None],
        "utt_ids": [u for u, _ in items],
    }


class SyntheticPretrainData(L.LightningDataModule):
    """Follows the data contract (batches, feature_dim, normalizer) without building a corpus."""

    def __init__(
        self, n_train: int = 64, n_val: int = 8, feature_dim: int = 16, batch_size: int = 8
    ) -> None:
        super().__init__()
        self.feature_dim = feature_dim
        self.batch_size = batch_size
        self.train = SyntheticSpeech(n_train, feature_dim, seed=0, short_every=16)
        self.val = SyntheticSpeech(n_val, feature_dim, seed=1)
        self.normalizer = Normalizer(torch.zeros(feature_dim), torch.ones(feature_dim))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=collate)
