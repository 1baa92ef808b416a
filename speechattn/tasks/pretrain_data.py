"""The pretraining view of a data module: the data layer's batches in a resumable order.

`ResumableData` wraps any DataModule of the data contract (docs/ARCHITECTURE.md) and only
replaces the order of training batches with `StepBatchSampler`: batch i is a function of
(seed, i, rank), sharded across DDP ranks, and a resumed run starts at the batch after the
checkpoint's step. Datasets, collation, workers and validation are the wrapped module's.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from speechattn.tasks.pretrain import SeededItems, StepBatchSampler


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
