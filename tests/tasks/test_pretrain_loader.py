"""The pretraining loader masks on the host: masks depend on (seed, batch number, rank) only."""

from __future__ import annotations

import torch
from _pretrain_testing import SyntheticPretrainData
from torch.utils.data import DataLoader

from speechattn.model.masking import MaskingConfig
from speechattn.tasks.pretrain import SeededItems, StepBatchSampler
from speechattn.tasks.pretrain.data import BatchMasker, MaskingCollate


def batches(workers: int, start: int = 0) -> list[dict]:
    data = SyntheticPretrainData(n_train=24, batch_size=4)
    sampler = StepBatchSampler(24, 4, total_batches=6, seed=3, start=start)
    masker = BatchMasker(stack=3, masking=MaskingConfig(), pad_to_multiple=16)
    loader = DataLoader(
        SeededItems(data.train), batch_sampler=sampler, collate_fn=MaskingCollate(data.train_dataloader().collate_fn, masker),
        num_workers=workers,
    )  # fmt: skip
    return list(loader)


def test_masks_resume_and_do_not_depend_on_workers():
    plain, workers, resumed = batches(0), batches(2), batches(0, start=3)
    for a, b in zip(plain, workers):
        assert torch.equal(a["masked"].chosen, b["masked"].chosen)
        assert torch.equal(a["masked"].inputs, b["masked"].inputs)
    for a, b in zip(plain[3:], resumed):
        assert torch.equal(a["masked"].inputs, b["masked"].inputs)
    assert not torch.equal(plain[0]["masked"].chosen[:, :8], plain[1]["masked"].chosen[:, :8])
    for batch in plain:
        m = batch["masked"]
        assert (
            m.inputs.shape[1] % 16 == 0
            and m.lengths.tolist() == ((batch["lengths"] + 2) // 3).tolist()
        )
