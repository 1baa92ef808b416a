"""Datasets over the feature cache, the padding collate, and a length-bucketing batch sampler.

Batches (docs/ARCHITECTURE.md): `features` float32 (B, T, F) normalised, zero past `lengths`;
`lengths` int64 (B,); `padding_mask` bool (B, T), True at padding; `utt_ids` list[str];
labelled data adds `speaker` int64 (B,), `phones` int64 (B, T) padded with -100 and
`phone_lengths` int64 (B,).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset, Sampler

from speechattn.data.cache import FeatureStore
from speechattn.data.features import Normalizer
from speechattn.utils import IGNORE_INDEX, lengths_to_padding_mask


class FeatureDataset(Dataset):
    """Normalised features of chosen utterances, optionally cropped, with optional labels.

    Args:
        store: the feature cache.
        indices: positions in `store` of this dataset's utterances.
        normalizer: applied to every utterance.
        max_frames: crop longer utterances to this many frames (None: never).
        random_crop: random window (training) or the first window (evaluation).
        speakers: class index per item (labelled data), or None.
        phones: per item, (T_lab,) int phone ids aligned to the features, or None.
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
        self.lengths = (
            np.minimum(full, max_frames) if max_frames else full
        )  # frames per item after cropping

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def utt_ids(self) -> list[str]:
        return [self.store.utt_ids[i] for i in self.indices]

    def __getitem__(self, item: int) -> dict[str, Any]:
        i = self.indices[item]
        x = self.store.raw(i)  # (T, F) read from its shard (pread), cache dtype
        T = x.shape[0]
        start = 0
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
    """Pad a list of dataset items into a batch dict (see the module docstring)."""
    lengths = torch.tensor([it["features"].shape[0] for it in items], dtype=torch.long)
    B, T, F = (
        len(items),
        int(lengths.max()) if items else 0,
        items[0]["features"].shape[1] if items else 0,
    )
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
        batch["phone_lengths"] = torch.tensor(
            [it["phones"].numel() for it in items], dtype=torch.long
        )
    return batch


class LengthBucketBatchSampler(BatchSampler):
    """Batches of similar length: sort pools of `bucket_size` batches, shuffle the batch order.

    Takes its indices from `sampler` (a RandomSampler, or the DistributedSampler Lightning
    injects under DDP -- Lightning re-creates this class with that sampler, so each rank buckets
    its own shard). With `shuffle=False` the whole index set is sorted by length, which gives
    the least padding for evaluation.

    Args:
        sampler: yields dataset indices.
        batch_size: utterances per batch.
        drop_last: drop a final smaller batch.
        lengths: frames of every dataset item (indexed by what `sampler` yields).
        bucket_size: batches per sorting pool.
        shuffle: shuffle the batch order (seeded by `seed` and an epoch counter).
        seed: base seed of the batch-order shuffle.
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
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        indices = list(iter(self.sampler))
        pool = len(indices) if not self.shuffle else self.batch_size * self.bucket_size
        batches: list[list[int]] = []
        for start in range(0, len(indices), max(pool, 1)):
            chunk = sorted(indices[start : start + pool], key=lambda i: (self.lengths[i], i))
            batches += [
                chunk[k : k + self.batch_size] for k in range(0, len(chunk), self.batch_size)
            ]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(batches))
            batches = [batches[i] for i in order]
            self.epoch += 1
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        if self.shuffle:  # pools are cut independently, so count per pool
            pool = self.batch_size * self.bucket_size
            full, rest = divmod(n, pool)
            per_pool = pool // self.batch_size
            if self.drop_last:
                return full * per_pool + rest // self.batch_size
            return full * per_pool + -(-rest // self.batch_size)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
