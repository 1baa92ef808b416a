"""Corpora at scale: the generated LibriSpeech-layout corpus, the capped and stable pretraining
validation set, and `bench loader` / `bench scale` on real data modules."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from speechattn.bench import loader as bench_loader
from speechattn.bench import scale as bench_scale
from speechattn.bench.corpus import make_scale_corpus
from speechattn.bench.pretrain import project_step
from speechattn.config import compose
from speechattn.data import DataConfig, PretrainDataModule
from speechattn.data.datamodules import validation_ids
from speechattn.data.librispeech import scan_split
from speechattn.tasks.pretrain import StepBatchSampler

SHORT = [0.3, 0.7, 1.1]  # seconds: extraction stays quick


# ----------------------------------------------------------------------------- generator


def test_scale_corpus_is_librispeech_layout_made_of_hard_links(tmp_path):
    root = make_scale_corpus(tmp_path / "c", 2500, speakers=25, chapters=3, seconds=SHORT)
    utts = scan_split(root, "train-clean-360")  # raises on any layout problem
    assert len(utts) == 2500 and len({u.speaker for u in utts}) == 25
    assert len({(u.speaker, u.chapter) for u in utts}) == 75
    assert all(u.transcript for u in utts)
    inodes = {os.stat(u.path).st_ino for u in utts}
    sources = sorted((root / "sources").glob("*.flac"))
    assert len(sources) == 3 and inodes == {os.stat(s).st_ino for s in sources}  # links only
    assert make_scale_corpus(root, 2500, speakers=25, chapters=3, seconds=SHORT) == root  # reused
    with pytest.raises(FileExistsError, match=f"{root} exists and is not this corpus"):
        make_scale_corpus(root, 2400, speakers=25, chapters=3, seconds=SHORT)
    default = make_scale_corpus(tmp_path / "d", 1130, seconds=SHORT)
    assert len({u.speaker for u in scan_split(default, "train-clean-360")}) == 10  # ~113 each


# ----------------------------------------------------------------------------- validation


def test_validation_is_capped_seeded_and_independent_of_order():
    ids = [f"{s}-{c}-{u:04d}" for s in range(100, 160) for c in (1, 2) for u in range(50)]
    held = validation_ids(ids, 0.05, 1000, seed=0)
    assert len(held) == 300  # 5 % of 6000, under the cap
    assert len(validation_ids(ids, 0.05, 120, seed=0)) == 120
    assert validation_ids(list(reversed(ids)), 0.05, 1000, seed=0) == held
    assert validation_ids(ids, 0.05, 1000, seed=1) != held
    assert (
        validation_ids(ids[:2], 0.9, None, seed=0)
        and len(validation_ids(ids[:2], 0.9, None, 0)) == 1
    )
    assert validation_ids(ids[:1], 0.5, None, 0) == set() == validation_ids(ids, 0.0, None, 0)


def test_a_grown_corpus_keeps_its_capped_validation_set_but_for_newcomers():
    ids = [f"{s}-1-{u:04d}" for s in range(100, 200) for u in range(100)]  # 10k
    new = [f"{s}-1-{u:04d}" for s in range(200, 210) for u in range(100)]  # +1k
    before = validation_ids(ids, 0.05, 200, seed=3)
    after = validation_ids(ids + new, 0.05, 200, seed=3)
    newcomers = after & set(new)
    assert len(after) == 200 and after - set(new) <= before  # no old utterance joins
    assert len(before - after) == len(newcomers) < 40  # each newcomer displaces one (~18 expected)


def test_pretrain_data_module_caps_validation(tmp_path):
    root = make_scale_corpus(tmp_path / "c", 300, speakers=6, seconds=SHORT)
    cfg = DataConfig(corpus="librispeech", root=str(root), pretrain_splits=["train-clean-360"],
                     cache_dir=str(tmp_path / "cache"), extract_workers=1, progress=False,
                     batch_size=4, max_val_utterances=7)  # fmt: skip
    dm = PretrainDataModule(cfg)
    dm.setup("fit")
    val = dm.datasets["val"].utt_ids
    ids = [u.utt_id for u in scan_split(root, "train-clean-360")]
    assert sorted(val) == sorted(validation_ids(ids, 0.05, 7, cfg.seed)) and len(val) == 7
    assert not set(val) & set(dm.datasets["train"].utt_ids) and len(dm.datasets["train"]) == 293
    assert sum(len(b["utt_ids"]) for b in dm.val_dataloader()) == 7
    uncapped = PretrainDataModule(dataclasses.replace(cfg, max_val_utterances=None, num_workers=2))
    uncapped.setup("fit")
    assert set(val) < set(uncapped.datasets["val"].utt_ids) and len(uncapped.datasets["val"]) == 15
    assert DataConfig().max_val_utterances == 1000
    with pytest.raises(
        ValueError, match="data.max_val_utterances=0: must be an integer >= 1, or null"
    ):
        DataConfig(max_val_utterances=0)


# ----------------------------------------------------------------------------- benchmarks


def _tiny_overrides(data: DataConfig) -> list[str]:
    return [f"data.root={data.root}", f"data.cache_dir={data.cache_dir}", "data.batch_size=4",
            "data.extract_workers=1", "data.shard_size=8", "data.progress=false",
            "data.max_frames=300"]  # fmt: skip


def test_bench_loader_times_the_training_loader_beside_the_gpu_need(
    tiny_data_config, tmp_path, capsys
):
    overrides = [*_tiny_overrides(tiny_data_config), "data.num_workers=0"]
    out = tmp_path / "loader.json"
    bench_loader.main([*overrides, "--batches", "3", "--warmup", "1", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r == json.loads(json.dumps(r)) and r["overrides"] == overrides
    # the frames counted are those of the very batches training's sampler gives (2, 3, 4)
    dm = PretrainDataModule(dataclasses.replace(tiny_data_config, max_frames=300))
    dm.setup("fit")
    train = dm.datasets["train"]
    sampler = StepBatchSampler(len(train), 4, 5, seed=compose("pretrain").seed,
                               lengths=train.lengths, bucket_size=dm.cfg.bucket_size)  # fmt: skip
    assert r["frames"] == sum(int(train.lengths[i]) for b in range(2, 5) for i in sampler.batch(b))
    assert r["frames_per_s"] == pytest.approx(r["frames"] / r["seconds"])
    _, need = project_step(compose("pretrain", overrides), "h100", 0.4)
    assert r["need"]["loader_frames_per_s"] == need["loader_frames_per_s"]
    assert r["ratio"] == pytest.approx(r["frames_per_s"] / need["loader_frames_per_s"])
    assert r["descriptors"]["main"] > 0 and r["descriptors"]["workers"] == []
    assert r["startup"]["cold"] is False and r["startup"]["wall_s"] >= 0
    printed = capsys.readouterr().out
    assert "M frames/s (10 ms)" in printed and "ratio measured / needed" in printed


def test_bench_loader_cold_start_extracts_into_a_scratch_cache_with_workers(tiny_data_config):
    scratch = set(Path(tempfile.gettempdir()).glob("speechattn-bench-loader-*"))
    cache = Path(tiny_data_config.cache_dir)
    before = sorted(p.name for p in cache.rglob("*"))
    args = bench_loader.parse([*_tiny_overrides(tiny_data_config), "data.num_workers=1",
                               "--batches", "2", "--warmup", "0", "--cold"])  # fmt: skip
    r = bench_loader.run(args)
    assert r["startup"]["cold"] is True and r["num_workers"] == 1
    assert len(r["descriptors"]["workers"]) == 1 and r["descriptors"]["workers"][0] > 0
    assert set(Path(tempfile.gettempdir()).glob("speechattn-bench-loader-*")) == scratch
    assert sorted(p.name for p in cache.rglob("*")) == before  # the real cache is untouched


@pytest.mark.slow
def test_bench_scale_measures_cold_and_warm_runs_per_size(tmp_path, capsys):
    out = tmp_path / "scale.json"
    bench_scale.main(["--work", str(tmp_path / "w"), "--sizes", "60,120", "--batches", "2",
                      "--warmup", "0", "--seconds", "0.5,1", "--json", str(out),
                      "data.batch_size=4", "data.num_workers=0", "data.extract_workers=1"])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["utterances"] for r in rows] == [60, 120]
    for r in rows:
        assert r["cold"]["train_utterances"] + r["cold"]["val_utterances"] == r["utterances"]
        assert r["cold_wall_s"] > r["warm_wall_s"] > 0 and r["frames_per_s"] > 0
    assert np.isfinite([r["warm_cpu_s"] for r in rows]).all()
    assert "M frames/s" in capsys.readouterr().out
