"""Datasets over the feature cache, the padding collate (the batch contract:
docs/ARCHITECTURE.md), and a length-bucketing batch sampler."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset, Sampler

from speechattn.data.cache import FeatureStore
from speechattn.data.features import Normalizer
from speechattn.utils import IGNORE_INDEX, derive_seed, lengths_to_padding_mask


class FeatureDataset(Dataset):
    """Normalised features of the utterances at `indices` of `store`, cropped to `max_frames`
    (None: never; a random window with `random_crop`, else the first), with optional labels:
    `speakers` a class per item, `phones` per item (T_lab,) phone ids aligned to the features.
    """

    def __init__(
        self,
        store: FeatureStore,
        indices: Sequence[int],
        normalizer: Normalizer,
        max_frames: int | None = None,
        random_crop: bool = False,
        speakers: Sequence[int] | None = None,
        phones: Sequence[np.ndarray] | None = None,
    ) -> None:
        self.store, self.indices = store, list(indices)
        self.normalizer, self.max_frames, self.random_crop = normalizer, max_frames, random_crop
        self.speakers, self.phones = speakers, phones
        full = store.lengths[self.indices] if self.indices else np.zeros(0, np.int64)
        self.lengths = np.minimum(full, max_frames) if max_frames else full  # after cropping

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def utt_ids(self) -> list[str]:
        return [self.store.utt_ids[i] for i in self.indices]

    def __getitem__(self, item: int) -> dict[str, Any]:
        i = self.indices[item]
        x = self.store.raw(i)  # (T, F) read from its shard (pread), cache dtype
        T, start = x.shape[0], 0
        if self.max_frames and T > self.max_frames:
            if self.random_crop:
                start = int(torch.randint(0, T - self.max_frames + 1, ()))
            x = x[start : start + self.max_frames]
        features = torch.from_numpy(self.normalizer.numpy(x))  # (T_crop, F) float32
        out: dict[str, Any] = {"features": features, "utt_id": self.store.utt_ids[i]}
        if self.speakers is not None:
            out["speaker"] = int(self.speakers[item])
        if self.phones is not None:
            labels = np.full(T, IGNORE_INDEX, dtype=np.int64)  # trim / pad (-100) to the frames
            lab = self.phones[item][:T]
            labels[: len(lab)] = lab
            out["phones"] = torch.from_numpy(labels[start : start + x.shape[0]])
        return out


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad dataset items into a batch: features (B, T, F) zero past `lengths`, padding_mask (B, T)
    True at padding, phones (B, T) padded with -100."""
    lengths = torch.tensor([it["features"].shape[0] for it in items], dtype=torch.long)
    B, T = len(items), int(lengths.max()) if items else 0
    F = items[0]["features"].shape[1] if items else 0
    features = np.zeros((B, T, F), dtype=np.float32)  # NumPy: single-threaded, no thread wake-ups
    for b, it in enumerate(items):
        features[b, : it["features"].shape[0]] = it["features"].numpy()
    batch: dict[str, Any] = {
        "features": torch.from_numpy(features),  # (B, T, F)
        "lengths": lengths,  # (B,)
        "padding_mask": lengths_to_padding_mask(lengths, T),  # (B, T)
        "utt_ids": [it["utt_id"] for it in items],
    }
    if items and "speaker" in items[0]:
        batch["speaker"] = torch.tensor([it["speaker"] for it in items], dtype=torch.long)
    if items and "phones" in items[0]:
        phones = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        for b, it in enumerate(items):
            phones[b, : it["phones"].numel()] = it["phones"].numpy()
        batch["phones"] = torch.from_numpy(phones)  # (B, T)
        batch["phone_lengths"] = torch.tensor([it["phones"].numel() for it in items])  # int64
    return batch


def length_buckets(
    pool: Sequence[int], lengths: Sequence[int], batch_size: int, seed: int | None
) -> list[list[int]]:
    """One pool cut into batches of similar length (both samplers' bucketing): `pool` (W,)
    items with `lengths` (W,) frames, sorted by length (stable), cut into ceil(W / batch_size)
    lists of ints and shuffled by `torch.randperm` seeded with `seed` (None: sorted order)."""
    items = np.asarray(pool, dtype=np.int64)[np.argsort(np.asarray(lengths), kind="stable")]
    batches = [items[k : k + batch_size].tolist() for k in range(0, len(items), batch_size)]
    if seed is None:
        return batches
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed))
    return [batches[j] for j in order.tolist()]


class LengthBucketBatchSampler(BatchSampler):
    """Epoch-wise batches of similar length: `length_buckets` on every pool of `bucket_size`
    batches' worth of the indices `sampler` yields (`lengths`: frames per dataset item), each
    pass in a new order seeded by `seed`, the pass and the pool; with `shuffle=False` all of
    them are one sorted pool (evaluation). Under DDP Lightning re-creates it with its
    DistributedSampler, so each rank buckets its own shard.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Sequence[int],
        batch_size: int,
        drop_last: bool,
        lengths: Sequence[int],
        bucket_size: int = 50,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.lengths = np.asarray(lengths)
        self.bucket_size, self.shuffle, self.seed = bucket_size, shuffle, seed
        self.epoch = 0  # passes begun: each draws its own batch order

    def _pool(self, n: int) -> int:  # indices per sorting pool, of `n` in a pass
        return self.batch_size * self.bucket_size if self.shuffle else max(n, 1)

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        pool, epoch = self._pool(len(indices)), self.epoch
        self.epoch += 1
        for k, start in enumerate(range(0, len(indices), pool)):
            chunk = indices[start : start + pool]
            seed = derive_seed(self.seed, "bucket-order", epoch, k) if self.shuffle else None
            for batch in length_buckets(chunk, self.lengths[chunk], self.batch_size, seed):
                if len(batch) == self.batch_size or not self.drop_last:
                    yield batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        pool, b = self._pool(n), self.batch_size
        sizes = (pool,) * (n // pool) + (n % pool,)  # pools are cut independently
        return sum(m // b if self.drop_last else -(-m // b) for m in sizes)
