"""The pretraining data order: every batch, its items' random crops and its masks a function
of (seed, batch number, rank), so a resume needs the step alone. `ResumableData` wraps any
DataModule of the data contract (docs/ARCHITECTURE.md) and replaces only the training order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from speechattn.data.datasets import length_buckets
from speechattn.errors import ConfigError
from speechattn.model.masking import MaskedBatch, MaskingConfig, mask_batch
from speechattn.utils import derive_seed


class StepBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of a whole run, each a pure function of (seed, batch number, rank), from batch
    `start` (no saved state); the length is the whole run, for Lightning's epoch bookkeeping.

    The index stream concatenates seeded permutations of the dataset, one per pass. With
    `lengths`, each pool of `bucket_size` global batches (G = batch_size * world_size items,
    rank r takes the r-th slice) is cut into length buckets (`length_buckets`). A pool holds
    at most half the dataset, so it spans at most two passes; there the later pass's first
    items that the earlier pass's tail in that pool holds are swapped further on, never into
    its own tail: no batch holds an item twice (needs N >= 2G - 1) and each pass depends on
    its own and the previous permutation only. Yields `BatchKeys` of (item seed, index).
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
            raise ConfigError("cannot sample batches from an empty training split")
        if batch_size < 1 or total_batches < 0 or bucket_size < 1:
            raise ConfigError(
                f"need batch_size, bucket_size >= 1 and total_batches >= 0, "
                f"got {batch_size}, {bucket_size}, {total_batches}"
            )
        if lengths is not None and len(lengths) != num_items:
            raise ValueError(f"{len(lengths)} lengths for {num_items} items")
        G = batch_size * world_size
        if num_items < 2 * G - 1:
            raise ConfigError(
                f"{num_items} training utterances for global batches of {G} (batch_size "
                f"{batch_size} x {world_size} ranks): a batch spanning two passes could hold "
                f"an utterance twice; use at least {2 * G - 1} utterances or a smaller "
                f"data.batch_size"
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.total_batches = total_batches
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        wanted = bucket_size if lengths is not None else 1
        self.bucket_size = max(1, min(wanted, num_items // (2 * G)))
        self.pool_items = self.bucket_size * G  # W: stream positions per pool
        self._passes: dict[int, np.ndarray] = {}  # the last few passes, by epoch
        self._pool: tuple[int, list[list[int]]] = (-1, [])

    def _permutation(self, epoch: int) -> np.ndarray:
        """(N,) the seeded permutation of pass `epoch`, before any swap."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, "data-order", epoch))
        return torch.randperm(self.num_items, generator=g).numpy()

    def _tail(self, epoch: int) -> int:
        """How many of pass `epoch`'s last items share a pool with the next pass (0: none)."""
        return (epoch + 1) * self.num_items % self.pool_items

    def _pass(self, epoch: int) -> np.ndarray:
        """(N,) dataset indices of pass `epoch`: its permutation, with the items of its first
        pool that the previous pass's last items in that pool already hold swapped further on
        (memoised: a pool reads at most two passes)."""
        if epoch not in self._passes:
            if len(self._passes) >= 3:
                del self._passes[next(iter(self._passes))]  # the oldest
            order = self._permutation(epoch)
            before = self._tail(epoch - 1) if epoch > 0 else 0
            if before:  # the previous pass's last `before` items share this pass's first pool
                N, head = self.num_items, self.pool_items - before
                taken = self._permutation(epoch - 1)[N - before :]  # a tail: never swapped
                twice = np.flatnonzero(np.isin(order[:head], taken))
                # N >= 2W - 1 leaves enough items between the head and this pass's own tail
                later = order[head : N - self._tail(epoch)]
                spare = head + np.flatnonzero(~np.isin(later, taken))[: len(twice)]
                order[twice], order[spare] = order[spare], order[twice].copy()
            self._passes[epoch] = order
        return self._passes[epoch]

    def _item(self, position: int) -> int:
        """Dataset index at `position` of the stream of passes."""
        return int(self._pass(position // self.num_items)[position % self.num_items])

    def _global_batches(self, pool: int) -> list[list[int]]:
        """The `bucket_size` global batches of one pool, as stream positions."""
        if self._pool[0] != pool:
            G, P, W = self.batch_size * self.world_size, self.bucket_size, self.pool_items
            positions = list(range(pool * W, (pool + 1) * W))
            # a lone global batch stays unsorted: sorting would hand rank 0 the short items
            batches = [positions]
            if self.lengths is not None and P > 1:
                lengths = [self.lengths[self._item(q)] for q in positions]
                seed = derive_seed(self.seed, "bucket-order", pool)
                batches = length_buckets(positions, lengths, G, seed)
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
            keys = [(derive_seed(self.seed, "item", q), self._item(q)) for q in self.positions(i)]
            yield BatchKeys(keys, derive_seed(self.seed, "mask", i, self.rank))

    def __len__(self) -> int:
        return self.total_batches


class BatchKeys(list):
    """One batch's item keys, or its items once `SeededItems` fetched them, with the seed of
    its masks (it travels to the workers with the keys: no dependence on worker or prefetch)."""

    def __init__(self, keys: list[Any], mask_seed: int | None) -> None:
        super().__init__(keys)
        self.mask_seed = mask_seed


class SeededItems(Dataset):
    """`dataset[(seed, index)]` -> `dataset[index]` with the global RNG (random crops) seeded
    for that item and restored after; a batch of keys (`__getitems__`) keeps its mask seed."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        seed, index = key
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: torch.manual_seed would queue CUDA seeding with a
            # formatted stack trace per item in workers
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> BatchKeys:
        return BatchKeys([self[key] for key in keys], getattr(keys, "mask_seed", None))


@dataclass(frozen=True)
class BatchMasker:
    """What the loader needs of the model to prepare a step: its frame stacking, masking
    settings and input limit, and the length bucket (`pad_to_multiple` model frames)."""

    stack: int
    masking: MaskingConfig
    pad_to_multiple: int = 1
    max_model_frames: int | None = None

    def __call__(self, features: Tensor, lengths: Tensor, seed: int) -> MaskedBatch:
        """features (B, T, F) 10 ms, lengths (B,) on the host -> a `MaskedBatch` (host)."""
        generator = torch.Generator().manual_seed(seed)
        return mask_batch(
            features,
            lengths,
            self.stack,
            self.masking,
            generator,
            self.pad_to_multiple,
            self.max_model_frames,
        )


class MaskingCollate:
    """collate_fn of the pretraining loader (picklable, runs in its workers): the wrapped
    collate's batch masked by `masker` -> {"masked": MaskedBatch, "lengths": (B,), "utt_ids"}."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]], masker: BatchMasker):
        self.collate = collate
        self.masker = masker

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        seed = getattr(items, "mask_seed", None)
        if seed is None:
            raise ValueError("MaskingCollate needs batches of StepBatchSampler keys (BatchKeys)")
        batch = self.collate(list(items))
        masked = self.masker(batch["features"], batch["lengths"], seed)
        return {"masked": masked, "lengths": batch["lengths"], "utt_ids": batch.get("utt_ids")}


class ResumableData(L.LightningDataModule):
    def __init__(
        self,
        inner: L.LightningDataModule,
        seed: int,
        batch_masker: Callable[[int], BatchMasker] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.seed = seed
        # `PretrainTask.batch_masker`, run by the loader; None: the wrapped module's batches
        self.batch_masker = batch_masker

    @property
    def normalizer(self) -> Any:
        """The wrapped module's `Normalizer`, available after setup."""
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
        trainer = self.trainer
        assert trainer is not None, "ResumableData must be attached to a Trainer"
        if trainer.max_steps is None or trainer.max_steps < 0:
            raise ConfigError("pretraining is defined in steps: set trainer.max_steps")
        accumulate = trainer.accumulate_grad_batches
        return self.step_loader(
            total_batches=trainer.max_steps * accumulate,
            # a checkpoint is written after an optimizer step: the batches before it are done
            start=trainer.global_step * accumulate,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
        )

    def step_loader(
        self, total_batches: int, start: int = 0, rank: int = 0, world_size: int = 1
    ) -> DataLoader:
        """The training loader of `total_batches` batches from batch `start`: the wrapped
        module's loader settings with `StepBatchSampler`'s order and `batch_masker` stacking
        and masking. `bench loader` times this very loader."""
        loader = self.inner.train_dataloader()
        batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if batch_size is None:
            raise ConfigError("cannot tell the training batch size; set data.batch_size")
        dataset = loader.dataset
        sampler = StepBatchSampler(
            num_items=len(dataset),  # type: ignore[arg-type]
            batch_size=int(batch_size),
            total_batches=total_batches,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
            start=start,
            lengths=getattr(dataset, "lengths", None),  # frames per item: length buckets
            bucket_size=int(getattr(loader.batch_sampler, "bucket_size", None) or 1),
        )
        collate = loader.collate_fn
        if self.batch_masker is not None:
            # model frames per length bucket: the wrapped module's `cfg.pad_to_multiple`, else 1
            pad = getattr(getattr(self.inner, "cfg", None), "pad_to_multiple", 1)
            collate = MaskingCollate(collate, self.batch_masker(int(pad)))
        workers = loader.num_workers
        return DataLoader(
            SeededItems(dataset),
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers if workers > 0 else False,
            prefetch_factor=loader.prefetch_factor if workers > 0 else None,
            worker_init_fn=loader.worker_init_fn,
        )

    def val_dataloader(self) -> Any:
        return self.inner.val_dataloader()

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Tensors to `device`, `lengths` (and a `MaskedBatch`'s) kept on the host: the model
        sizes the step from them without a sync (`padding_mask_for`)."""
        if isinstance(batch, dict) and isinstance(batch.get("lengths"), Tensor):
            rest = {k: v for k, v in batch.items() if k != "lengths"}
            moved = super().transfer_batch_to_device(rest, device, dataloader_idx)
            return {**moved, "lengths": batch["lengths"]}
        return super().transfer_batch_to_device(batch, device, dataloader_idx)
