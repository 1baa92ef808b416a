"""Data modules: the batch contract, roles and splits, crops, bucketing, DDP sampler injection."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, SequentialSampler

from speechattn.data import DataConfig, LabelledDataModule, PretrainDataModule
from speechattn.data.datasets import LengthBucketBatchSampler, length_buckets
from speechattn.utils import IGNORE_INDEX


def _check_common(batch):
    B, T, F = batch["features"].shape
    assert batch["features"].dtype == torch.float32 and F == 80
    assert batch["lengths"].dtype == torch.int64 and batch["lengths"].shape == (B,)
    assert batch["padding_mask"].dtype == torch.bool and batch["padding_mask"].shape == (B, T)
    assert isinstance(batch["utt_ids"], list) and len(batch["utt_ids"]) == B
    assert int(batch["lengths"].max()) == T
    for b in range(B):
        n = int(batch["lengths"][b])
        assert not batch["padding_mask"][b, :n].any() and batch["padding_mask"][b, n:].all()
        assert (batch["features"][b, n:] == 0).all()


def test_labelled_batches_follow_the_contract(tiny_data_config):
    dm = LabelledDataModule(tiny_data_config)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_speakers == 4 and dm.num_phones == 40 and dm.phone_set[0] == "sil"
    assert dm.feature_dim == 80 and dm.normalizer.mean.shape == (80,)
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        for batch in loader:
            _check_common(batch)
            B, T = batch["phones"].shape
            assert batch["speaker"].dtype == torch.int64 and batch["speaker"].shape == (B,)
            assert batch["speaker"].min() >= 0 and batch["speaker"].max() < dm.num_speakers
            assert batch["phone_lengths"].tolist() == batch["lengths"].tolist()
            for b in range(B):
                n = int(batch["phone_lengths"][b])
                assert (batch["phones"][b, n:] == IGNORE_INDEX).all()
                valid = batch["phones"][b, :n]
                assert ((valid >= 0) & (valid < 40)).all() or (valid == IGNORE_INDEX).sum() <= 2


def test_labelled_roles_follow_the_split_lists(tiny_data_config, tiny_corpus):
    dm = LabelledDataModule(tiny_data_config)
    dm.setup("fit")
    ids = {name: set(ds.utt_ids) for name, ds in dm.datasets.items()}
    listed_train = set((tiny_corpus / "train_split.txt").read_text().split())
    assert ids["test"] == set((tiny_corpus / "test_split.txt").read_text().split())
    assert ids["train"] | ids["dev"] == listed_train and not ids["train"] & ids["dev"]
    assert len(ids["dev"]) == 4  # one per speaker (10 % of 5, at least one)
    speakers = lambda s: {u.split("-")[0] for u in s}  # noqa: E731
    assert speakers(ids["train"]) == speakers(ids["dev"]) == speakers(ids["test"])
    again = LabelledDataModule(tiny_data_config)
    again.setup("fit")
    assert set(again.datasets["dev"].utt_ids) == ids["dev"]  # seeded
    other = LabelledDataModule(dataclasses.replace(tiny_data_config, seed=5))
    other.setup("fit")
    assert set(other.datasets["dev"].utt_ids) != ids["dev"]


def test_speaker_labels_match_folders(tiny_data_config):
    dm = LabelledDataModule(tiny_data_config)
    dm.setup("fit")
    for batch in dm.extraction_dataloader("train"):
        for utt, spk in zip(batch["utt_ids"], batch["speaker"].tolist()):
            assert dm.speakers[spk] == utt.split("-")[0]


def test_test_from_folders_instead_of_a_list(tiny_data_config, tiny_corpus, tmp_path, caplog):
    import shutil

    from speechattn.data.synth import build_corpus

    root = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, root)
    held = build_corpus(
        tmp_path / "held", speakers=2, utterances_per_speaker=2, heldout=True, workers=1
    )
    shutil.move(held / "synth-heldout", root / "synth-heldout")
    cfg = dataclasses.replace(
        tiny_data_config,
        root=str(root),
        train_list=None,
        test_list=None,
        test_splits=["synth-heldout"],
        alignments=None,
    )
    dm = LabelledDataModule(cfg)
    dm.setup("fit")
    assert (
        len(dm.datasets["train"]) + len(dm.datasets["dev"]) == 24 and len(dm.datasets["test"]) == 4
    )
    assert {u.split("-")[0] for u in dm.datasets["test"].utt_ids} == {"7001", "7002"}
    assert dm.num_speakers == 6 and "never occur in train" in caplog.text


def test_no_alignments_gives_ignored_phones(tiny_data_config):
    dm = LabelledDataModule(dataclasses.replace(tiny_data_config, alignments=None))
    dm.setup("fit")
    assert dm.num_phones == 0 and dm.num_speakers == 4
    batch = next(iter(dm.test_dataloader()))
    assert (batch["phones"] == IGNORE_INDEX).all()


def test_pretrain_crops_buckets_and_excludes_test(tiny_data_config, tiny_corpus):
    cfg = dataclasses.replace(
        tiny_data_config, max_frames=200, min_frames=10, pretrain_val_fraction=0.1
    )
    dm = PretrainDataModule(cfg)
    dm.prepare_data()
    dm.setup("fit")
    test_ids = set((tiny_corpus / "test_split.txt").read_text().split())
    train_ids, val_ids = set(dm.datasets["train"].utt_ids), set(dm.datasets["val"].utt_ids)
    assert (
        not (train_ids | val_ids) & test_ids
        and len(train_ids | val_ids) == 20
        and len(val_ids) == 2
    )
    torch.manual_seed(0)
    first = [b for b in dm.train_dataloader()]
    torch.manual_seed(1)
    second = [b for b in dm.train_dataloader()]
    for batch in first:
        _check_common(batch)
        assert batch["features"].shape[1] <= 200 and "speaker" not in batch
    starts = lambda bs: {u: b["features"][i, 0, :4] for b in bs for i, u in enumerate(b["utt_ids"])}  # noqa: E731
    s1, s2 = starts(first), starts(second)
    assert any(not torch.equal(s1[u], s2[u]) for u in s1)  # random crops differ between epochs
    assert sum(len(b["utt_ids"]) for b in first) == 18
    val = list(dm.val_dataloader())
    assert sum(len(b["utt_ids"]) for b in val) == 2


def test_short_utterances_are_used_whole(tiny_data_config):
    dm = PretrainDataModule(dataclasses.replace(tiny_data_config, max_frames=1500, batch_size=8))
    dm.setup("fit")
    lengths = dm.datasets["train"].lengths
    for batch in dm.train_dataloader():
        for u, n in zip(batch["utt_ids"], batch["lengths"].tolist()):
            assert n == lengths[dm.datasets["train"].utt_ids.index(u)] < 1500


def test_long_labelled_utterances_are_cropped_with_their_labels(tiny_data_config, tiny_corpus):
    dm = LabelledDataModule(dataclasses.replace(tiny_data_config, labelled_max_frames=100))
    dm.setup("fit")
    labels = {}
    for line in (tiny_corpus / "converted_aligned_phones.txt").read_text().splitlines():
        utt, *rest = line.split()
        labels[utt] = [int(x) for x in rest]
    for batch in dm.test_dataloader():  # evaluation: the first window, deterministically
        assert batch["features"].shape[1] == 100
        for b, utt in enumerate(batch["utt_ids"]):
            assert batch["phones"][b].tolist() == labels[utt][:100]
    for batch in dm.train_dataloader():  # training: a random window, labels cut alike
        assert batch["features"].shape[1] == 100 and batch["phones"].shape == (
            len(batch["utt_ids"]),
            100,
        )
        for b, utt in enumerate(batch["utt_ids"]):
            window = batch["phones"][b].tolist()
            full = labels[utt]
            assert any(full[s : s + 100] == window for s in range(len(full) - 99))


def test_loader_workers_reopen_the_memory_maps(tiny_data_config):
    dm = PretrainDataModule(dataclasses.replace(tiny_data_config, num_workers=1))
    dm.setup("fit")
    ids = [u for batch in dm.train_dataloader() for u in batch["utt_ids"]]
    assert sorted(ids) == sorted(dm.datasets["train"].utt_ids)


def test_length_buckets_sort_cut_and_shuffle_one_pool():
    pool, lengths = [9, 4, 7, 1, 3], [30, 10, 10, 50, 20]
    assert length_buckets(pool, lengths, 2, None) == [[4, 7], [3, 9], [1]]  # ties: pool order
    shuffled = length_buckets(pool, lengths, 2, seed=5)
    assert sorted(shuffled) == [[1], [3, 9], [4, 7]] == sorted(length_buckets(pool, lengths, 2, 6))
    assert shuffled == length_buckets(pool, lengths, 2, seed=5)  # the seed alone decides


def test_bucketing_reduces_padding():
    lengths = np.random.default_rng(0).integers(50, 1000, size=400)
    seq = SequentialSampler(range(400))
    bucketed = LengthBucketBatchSampler(
        seq, 16, False, lengths, bucket_size=10, shuffle=True, seed=0
    )
    batches = list(bucketed)
    assert sorted(i for b in batches for i in b) == list(range(400)) and len(batches) == len(
        bucketed
    )
    padding = lambda bs: sum(len(b) * lengths[b].max() - lengths[b].sum() for b in bs)  # noqa: E731
    plain = [list(range(i, min(i + 16, 400))) for i in range(0, 400, 16)]
    assert padding(batches) < 0.3 * padding(plain)
    assert [b for b in bucketed] != batches  # a new batch order every epoch


def test_batch_sampler_accepts_a_distributed_sampler():
    """Lightning re-creates the batch sampler with a DistributedSampler under DDP."""
    lengths = np.arange(100)
    parts = []
    for rank in range(2):
        sampler = DistributedSampler(range(100), num_replicas=2, rank=rank, shuffle=True, seed=0)
        parts.append([i for b in LengthBucketBatchSampler(sampler, 8, False, lengths) for i in b])
    assert not set(parts[0]) & set(parts[1]) and len(parts[0]) + len(parts[1]) == 100


def test_lightning_injects_a_distributed_sampler(tiny_data_config):
    """The path Lightning takes under DDP: capture the loader's args, re-create it per rank."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DataLoader

    dm = LabelledDataModule(tiny_data_config)
    dm.setup("fit")
    seen = []
    for rank in range(2):
        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            loader = dm.train_dataloader()  # as Lightning's _request_dataloader does
        sampler = DistributedSampler(
            loader.dataset, num_replicas=2, rank=rank, shuffle=True, seed=0
        )
        ranked = _update_dataloader(loader, sampler)
        assert isinstance(ranked.batch_sampler, LengthBucketBatchSampler)
        assert ranked.batch_sampler.sampler is sampler
        seen.append([u for b in ranked for u in b["utt_ids"]])
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == 16


def test_datamodule_in_a_lightning_fit(tiny_data_config):
    """Lightning accepts the loaders (sampler injection path included) and iterates them."""
    import lightning as L

    class Probe(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(80, 4)
            self.seen = 0

        def training_step(self, batch, _):
            self.seen += len(batch["utt_ids"])
            x = batch["features"].mean(1)
            return torch.nn.functional.cross_entropy(self.layer(x), batch["speaker"])

        def validation_step(self, batch, _):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = LabelledDataModule(tiny_data_config)
    probe = Probe()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True)  # fmt: skip
    trainer.fit(probe, datamodule=dm)
    assert probe.seen == 16


def test_config_validation():
    with pytest.raises(ValueError, match="on_error"):
        DataConfig(on_error="ignore")
    with pytest.raises(ValueError, match="root is required"):
        DataConfig(corpus="librispeech")
    with pytest.raises(ValueError, match="test_splits"):
        DataConfig(test_list=None)
    assert DataConfig(pretrain_splits="a").pretrain_splits == ["a"]
    assert DataConfig(deltas=True).feature_dim == 240


def test_normalizer_needs_setup(tiny_data_config):
    with pytest.raises(RuntimeError, match="setup"):
        _ = LabelledDataModule(tiny_data_config).normalizer
