"""The pretraining data order: every batch a function of (seed, batch number, rank).

`StepBatchSampler` makes the order and `SeededItems` seeds each item's random crop, so a run
resumed from any checkpoint sees exactly the batches of an uninterrupted one. `ResumableData` wraps any DataModule of the data contract (docs/ARCHITECTURE.md) and only
replaces the order of training batches with `StepBatchSampler`: batch i is a function of
(seed, i, rank), sharded across DDP ranks, and a resumed run starts at the batch after the
checkpoint's step. Datasets, collation, workers and validation are the wrapped module's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from speechattn.utils import derive_seed

# ----------------------------------------------------------------------------- data order


class StepBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of a whole run, each a pure function of (seed, batch number, rank).

    The index stream is the concatenation of seeded permutations of the dataset, one per
    pass. With `lengths`, every pool of `bucket_size` consecutive global batches is sorted by
    length, cut into batches and put in a seeded random order (less padding, same items).
    Global batch i has G = batch_size * world_size items and rank r takes its r-th slice.

    Iteration starts at `start`, the number of batches already consumed (from the checkpoint
    when resuming), so the sampler needs no saved state. The length is the whole run, which
    keeps Lightning's epoch bookkeeping consistent on resume. Each yielded key is
    (item seed, dataset index): `SeededItems` seeds random crops with it, so even the crops
    do not depend on how far the loader had prefetched when a run was killed.
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        total_batches: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        lengths: Sequence[int] | None = None,
        bucket_size: int = 1,
    ) -> None:
        if num_items < 1:
            raise ValueError("cannot sample batches from an empty training split")
        if batch_size < 1 or total_batches < 0 or bucket_size < 1:
            raise ValueError(
                f"need batch_size, bucket_size >= 1 and total_batches >= 0, "
                f"got {batch_size}, {bucket_size}, {total_batches}"
            )
        if lengths is not None and len(lengths) != num_items:
            raise ValueError(f"{len(lengths)} lengths for {num_items} items")
        self.num_items = num_items
        self.batch_size = batch_size
        self.total_batches = total_batches
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.bucket_size = bucket_size if lengths is not None else 1
        self._perm: tuple[int, list[int]] = (-1, [])
        self._pool: tuple[int, list[list[int]]] = (-1, [])

    def _item(self, position: int) -> int:
        """Dataset index at `position` of the stream of seeded permutations."""
        epoch = position // self.num_items
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "data-order", epoch))
            self._perm = (epoch, torch.randperm(self.num_items, generator=g).tolist())
        return self._perm[1][position % self.num_items]

    def _global_batches(self, pool: int) -> list[list[int]]:
        """The `bucket_size` global batches of one pool, as stream positions."""
        if self._pool[0] != pool:
            G, P = self.batch_size * self.world_size, self.bucket_size
            positions = list(range(pool * P * G, (pool + 1) * P * G))
            if self.lengths is not None and P > 1:
                lengths = self.lengths
                positions.sort(key=lambda q: (lengths[self._item(q)], q))
            batches = [positions[k * G : (k + 1) * G] for k in range(P)]
            if P > 1:
                g = torch.Generator().manual_seed(derive_seed(self.seed, "bucket-order", pool))
                batches = [batches[j] for j in torch.randperm(P, generator=g).tolist()]
            self._pool = (pool, batches)
        return self._pool[1]

    def positions(self, i: int) -> list[int]:
        """Stream positions of this rank's share of global batch i."""
        batch = self._global_batches(i // self.bucket_size)[i % self.bucket_size]
        return batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def batch(self, i: int) -> list[int]:
        """Dataset indices of this rank's share of global batch i."""
        return [self._item(q) for q in self.positions(i)]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for i in range(self.start, self.total_batches):
            yield [(derive_seed(self.seed, "item", q), self._item(q)) for q in self.positions(i)]

    def __len__(self) -> int:
        return self.total_batches


class SeededItems(Dataset):
    """`dataset[(seed, index)]` -> `dataset[index]` with the global RNG seeded for that item
    (the data layer's random crops draw from it) and restored afterwards."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        seed, index = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]


# ----------------------------------------------------------------------------- data module


class ResumableData(L.LightningDataModule):
    def __init__(
        self,
        inner: L.LightningDataModule,
        seed: int,
        batch_size: int | None = None,
        bucket_size: int | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.seed = seed
        self.batch_size = batch_size  # None: the wrapped loader's
        self.bucket_size = bucket_size  # None: the wrapped batch sampler's, else 1
        self.sampler: StepBatchSampler | None = None

    @property
    def normalizer(self) -> Any:
        """The wrapped module's `Normalizer` (training-split mean/std), available after setup."""
        return self.inner.normalizer

    def describe(self) -> dict[str, Any]:
        """Corpus facts for the upstream metadata (the wrapped module's, when it has them)."""
        describe = getattr(self.inner, "describe", None)
        return dict(describe()) if callable(describe) else {}

    @property
    def feature_dim(self) -> int:
        return int(self.inner.feature_dim)

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, stage: str) -> None:
        self.inner.setup(stage)

    def train_dataloader(self) -> DataLoader:
        loader = self.inner.train_dataloader()
        trainer = self.trainer
        assert trainer is not None, "ResumableData must be attached to a Trainer"
        if trainer.max_steps is None or trainer.max_steps < 0:
            raise ValueError("pretraining is defined in steps: set trainer.max_steps")
        accumulate = trainer.accumulate_grad_batches
        batch_size = self.batch_size or loader.batch_size
        if batch_size is None:
            batch_size = getattr(loader.batch_sampler, "batch_size", None)
        if batch_size is None:
            raise ValueError("cannot tell the training batch size; set data.batch_size")
        dataset = loader.dataset
        lengths = getattr(dataset, "lengths", None)  # frames per item: enables length buckets
        bucket = self.bucket_size or getattr(loader.batch_sampler, "bucket_size", None) or 1
        self.sampler = StepBatchSampler(
            num_items=len(dataset),  # type: ignore[arg-type]
            batch_size=int(batch_size),
            total_batches=trainer.max_steps * accumulate,
            seed=self.seed,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            # a checkpoint is written after an optimizer step: the batches before it are done
            start=trainer.global_step * accumulate,
            lengths=lengths,
            bucket_size=int(bucket),
        )
        return DataLoader(
            SeededItems(dataset),
            batch_sampler=self.sampler,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
            worker_init_fn=loader.worker_init_fn,
        )

    def val_dataloader(self) -> Any:
        return self.inner.val_dataloader()
