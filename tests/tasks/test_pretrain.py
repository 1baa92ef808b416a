"""Pretraining end to end on synthetic speech: learning, outputs, export, resume, faults."""

from __future__ import annotations

import math
import time

import pytest
import torch
from _pretrain_testing import SyntheticPretrainData, compose_pretrain
from torch.utils.data import DataLoader, Dataset

import speechattn
from speechattn.model.optim import lr_factor
from speechattn.pretrain import run
from speechattn.tasks.common import read_metrics
from speechattn.tasks.pretrain import (
    NonFiniteLossError,
    NonFiniteWarning,
    PretrainTask,
    SeededItems,
    StepBatchSampler,
    export_upstream,
)

SYNTH = ("~data",)  # the tests pass SyntheticPretrainData to run() directly


def train_losses(path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(path) if not math.isnan(r["train_loss"])]


def test_final_weights_are_validated_when_the_run_ends_between_validations(tmp_path):
    cfg = compose_pretrain(
        tmp_path, *SYNTH, "trainer.max_steps=25", "trainer.val_check_interval=10"
    )
    result = run(cfg, datamodule=SyntheticPretrainData())
    rows = read_metrics(tmp_path / "metrics.csv")
    validated = [(r["step"], r["val_loss"]) for r in rows if not math.isnan(r["val_loss"])]
    assert [step for step, _ in validated] == [0, 10, 20, 25]
    assert result["val_loss"] == pytest.approx(validated[-1][1], rel=1e-5)
    meta = speechattn.load_upstream(result["upstream"]).metadata
    assert meta["val_loss"] == result["val_loss"]
    # the extra validation used to erase train_loss from Lightning's metrics: metadata had None
    assert (
        meta["train_loss"]
        == result["train_loss"]
        == pytest.approx(train_losses(tmp_path / "metrics.csv")[-1], rel=1e-5)
    )


def test_short_run_learns_and_writes_the_run_directory(tmp_path):
    cfg = compose_pretrain(
        tmp_path,
        *SYNTH,
        "trainer.max_steps=40",
        "trainer.val_check_interval=20",
        "logger=tensorboard",
    )
    result = run(cfg, datamodule=SyntheticPretrainData())
    assert result["steps"] == 40
    losses = train_losses(tmp_path / "metrics.csv")
    assert len(losses) >= 15
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows if not math.isnan(r["val_loss"])] == [0, 20, 40]
    assert all(r["frames_per_s"] > 0 for r in rows[1:] if not math.isnan(r["train_loss"]))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"checkpoints", "upstream.pt", "metrics.csv", "config.yaml", "tensorboard"} <= names
    ckpts = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert {"last.ckpt", "step=0000004.ckpt", "step=0000040.ckpt"} <= ckpts
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    up = speechattn.load_upstream(result["upstream"])
    meta = up.metadata
    assert meta["steps"] == 40 and meta["seed"] == cfg.seed and meta["attention"] == "full"
    assert meta["code_version"].startswith(speechattn.__version__)
    assert up.hidden_dim == 32 and up.num_layers == 2


class SlowLoaderData(SyntheticPretrainData):
    """Every training item takes `delay` seconds to load (in the main process)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def train_dataloader(self) -> DataLoader:
        items = self.train

        class Slow(Dataset):
            def __len__(self) -> int:
                return len(items)

            def __getitem__(slow_self, i: int):  # noqa: N805
                time.sleep(self.delay)
                return items[i]

        loader = super().train_dataloader()
        return DataLoader(
            Slow(), batch_size=loader.batch_size, shuffle=True, collate_fn=loader.collate_fn
        )


def test_data_wait_is_the_share_of_each_batch_spent_waiting_for_it():
    """A batch's time runs from the previous batch's end to its own end; `data_wait` is the
    part of it before the batch starts. The first batch and those after a pause (validation,
    checkpoint) are not measured."""
    from types import SimpleNamespace

    from speechattn.tasks.common import DataWait

    now = [0.0]
    logged = []
    module = SimpleNamespace(log=lambda name, value, **kw: logged.append(float(value)))
    wait = DataWait(clock=lambda: now[0])

    def batch(waiting: float, working: float) -> None:
        now[0] += waiting
        wait.on_train_batch_start(None, module)
        now[0] += working
        wait.on_train_batch_end(None, module)

    wait.on_train_start(None, module)
    batch(0.5, 0.1)  # the first: no previous end to count from
    batch(0.3, 0.1)  # waited 0.3 of 0.4
    batch(0.0, 0.2)  # the loader kept up
    wait.on_validation_start(None, module)
    now[0] += 5.0  # the validation's time is not the loader's
    batch(0.1, 0.1)
    batch(0.1, 0.3)
    assert logged == pytest.approx([0.75, 0.0, 0.25])


def test_data_wait_is_logged_in_the_run_and_reaches_the_metadata(tmp_path):
    """Every logged step has `data_wait` in [0, 1) and its median reaches the metadata."""
    cfg = compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=12", "trainer.log_every_n_steps=1")
    result = run(cfg, datamodule=SlowLoaderData(0.001))
    rows = read_metrics(tmp_path / "metrics.csv")
    values = [r["data_wait"] for r in rows if not math.isnan(r["data_wait"])]
    assert len(values) >= 9 and all(0 <= v < 1 for v in values)
    median = speechattn.load_upstream(result["upstream"]).metadata["data_wait"]
    assert min(values) <= median <= max(values)


def test_checkpoint_to_upstream_round_trip_is_exact(tmp_path):
    cfg = compose_pretrain(tmp_path, *SYNTH, "attention=ldsa")
    run(cfg, datamodule=SyntheticPretrainData())
    ckpt = tmp_path / "checkpoints" / "step=0000004.ckpt"
    task = PretrainTask.load_from_checkpoint(
        str(ckpt), map_location="cpu", weights_only=True
    ).eval()
    out = export_upstream(ckpt, tmp_path / "from_ckpt.pt")
    up = speechattn.load_upstream(out)
    assert up.metadata["steps"] == 4 and up.attention_name == "ldsa"
    batch = next(iter(SyntheticPretrainData().val_dataloader()))
    with torch.no_grad():
        ref = task.model(batch["features"], batch["lengths"])
        got = up(batch["features"], batch["lengths"]).hidden_states
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # the run's final upstream.pt holds the weights of last.ckpt
    last = PretrainTask.load_from_checkpoint(
        str(tmp_path / "checkpoints" / "last.ckpt"), map_location="cpu", weights_only=True
    )
    final = speechattn.load_upstream(tmp_path / "upstream.pt")
    for k, v in last.model.state_dict().items():
        assert torch.equal(v, final.model.state_dict()[k]), k


def test_resume_after_crash_equals_uninterrupted_run(tmp_path, monkeypatch):
    steps = (
        "trainer.max_steps=12",
        "checkpoint.every_n_steps=4",
        "trainer.val_check_interval=6",
        "model.net.dropout=0.1",  # dropout's RNG must resume too
    )
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    run(compose_pretrain(ref_dir, *SYNTH, *steps), datamodule=SyntheticPretrainData())

    original = PretrainTask.training_step

    def crash_at_step_7(self, batch, batch_idx):
        if self.global_step == 7:
            raise RuntimeError("simulated crash")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(PretrainTask, "training_step", crash_at_step_7)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(compose_pretrain(crash_dir, *SYNTH, *steps), datamodule=SyntheticPretrainData())
    monkeypatch.setattr(PretrainTask, "training_step", original)
    assert (crash_dir / "checkpoints" / "last.ckpt").is_file()

    resumed = run(
        compose_pretrain(crash_dir, *SYNTH, *steps, "ckpt_path=last"),
        datamodule=SyntheticPretrainData(),
    )
    assert resumed["steps"] == 12
    ref_rows, got_rows = (
        read_metrics(ref_dir / "metrics.csv"),
        read_metrics(crash_dir / "metrics.csv"),
    )
    assert [r["step"] for r in got_rows] == [r["step"] for r in ref_rows]
    for a, b in zip(ref_rows, got_rows):
        for key in ("train_loss", "val_loss", "lr"):
            assert (math.isnan(a[key]) and math.isnan(b[key])) or a[key] == pytest.approx(
                b[key], rel=1e-5
            )
    ref_up = torch.load(ref_dir / "upstream.pt", weights_only=True)["state_dict"]
    got_up = torch.load(crash_dir / "upstream.pt", weights_only=True)["state_dict"]
    for k in ref_up:
        torch.testing.assert_close(got_up[k], ref_up[k], atol=1e-6, rtol=1e-5)


def test_nonfinite_loss_is_skipped_with_a_warning(tmp_path, monkeypatch):
    original = PretrainTask.reconstruction_loss
    weights = {}

    def nan_at_step_3(self, batch, generator):
        loss, frames, chosen = original(self, batch, generator)
        if self.training and self.global_step == 3:
            weights["before"] = {k: v.clone() for k, v in self.model.state_dict().items()}
            return loss * float("nan"), frames, chosen
        if self.training and self.global_step == 4 and "after" not in weights:
            weights["after"] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return loss, frames, chosen

    monkeypatch.setattr(PretrainTask, "reconstruction_loss", nan_at_step_3)
    with pytest.warns(NonFiniteWarning, match="step 3: non-finite loss"):
        result = run(compose_pretrain(tmp_path, *SYNTH), datamodule=SyntheticPretrainData())
    assert result["steps"] == 8 and math.isfinite(result["train_loss"])
    for k, v in weights["before"].items():  # the NaN step changed nothing
        assert torch.equal(v, weights["after"][k]), k


def test_too_many_nonfinite_steps_in_a_row_abort_with_a_clear_message(tmp_path, monkeypatch):
    original = PretrainTask.reconstruction_loss

    def nan_from_step_5(self, batch, generator):
        loss, frames, chosen = original(self, batch, generator)
        bad = self.training and self.global_step >= 5
        return (loss * float("inf") if bad else loss), frames, chosen

    monkeypatch.setattr(PretrainTask, "reconstruction_loss", nan_from_step_5)
    cfg = compose_pretrain(tmp_path, *SYNTH, "max_nonfinite=3")  # lr 1e-2, checkpoint at step 4
    with (
        pytest.warns(NonFiniteWarning),
        pytest.raises(NonFiniteLossError, match="3 non-finite") as e,
    ):
        run(cfg, datamodule=SyntheticPretrainData())
    assert "model.optimizer.lr=0.001 (now 0.01)" in str(e.value)  # smaller, not the same
    assert "ckpt_path=last" in str(e.value)  # checkpoints/last.ckpt of step 4 exists
    assert not (tmp_path / "upstream.pt").exists()


@pytest.mark.parametrize("abort_early", [False, True])
def test_a_diverged_run_fails_and_writes_no_upstream(tmp_path, abort_early):
    """lr=1e9: the run must not end normally with an upstream.pt whose hidden states are all
    NaN (it used to: exit 0, val_loss nan). Resuming is suggested only when a checkpoint exists
    (abort_early: the guard stops at step 2, before the first checkpoint at step 4)."""
    overrides = ["model.optimizer.lr=1e9", "trainer.max_steps=5"]
    overrides += ["max_nonfinite=2"] if abort_early else []
    with pytest.warns(NonFiniteWarning), pytest.raises(NonFiniteLossError) as e:
        run(compose_pretrain(tmp_path, *SYNTH, *overrides), datamodule=SyntheticPretrainData())
    message = str(e.value)
    assert "non-finite" in message and "model.optimizer.lr=1e+08 (now 1e+09)" in message
    assert not (tmp_path / "upstream.pt").exists()
    has_checkpoint = (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert has_checkpoint != abort_early
    assert ("ckpt_path=last" in message) == has_checkpoint


def test_nonfinite_weights_stop_training_at_once(tmp_path, monkeypatch):
    """An update that leaves a NaN weight stops the run before any checkpoint keeps it."""
    original = PretrainTask.optimizer_step

    def poisoned_step_6(self, *args, **kwargs):
        if self.global_step == 5:  # the sixth update
            with torch.no_grad():
                next(self.model.parameters())[0] = float("nan")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PretrainTask, "optimizer_step", poisoned_step_6)
    with pytest.raises(NonFiniteLossError, match="diverged at step 5.*1 parameter tensor") as e:
        run(compose_pretrain(tmp_path, *SYNTH), datamodule=SyntheticPretrainData())
    assert "ckpt_path=last" in str(e.value)  # the step-4 checkpoint exists
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert not (tmp_path / "upstream.pt").exists()


def test_nonfinite_final_validation_fails_and_writes_no_upstream(tmp_path, monkeypatch):
    original = PretrainTask.reconstruction_loss

    def nan_in_validation(self, batch, generator):
        loss, frames, chosen = original(self, batch, generator)
        return (loss if self.training else loss * float("nan")), frames, chosen

    monkeypatch.setattr(PretrainTask, "reconstruction_loss", nan_in_validation)
    with pytest.raises(NonFiniteLossError, match="final validation loss is nan"):
        run(compose_pretrain(tmp_path, *SYNTH), datamodule=SyntheticPretrainData())
    assert not (tmp_path / "upstream.pt").exists()


def test_nonfinite_upstream_is_never_written_or_loaded(tmp_path):
    from speechattn.model.upstream import NonFiniteWeightsError

    run(
        compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=4"),
        datamodule=SyntheticPretrainData(),
    )
    state = torch.load(tmp_path / "upstream.pt", weights_only=True)
    name = next(iter(state["state_dict"]))
    state["state_dict"][name][0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=f"not writing .*nan.pt.*{name}"):
        speechattn.model.upstream.save_upstream(tmp_path / "nan.pt", state)
    assert not (tmp_path / "nan.pt").exists()
    torch.save(state, tmp_path / "nan.pt")  # written by something else
    with pytest.raises(NonFiniteWeightsError, match=f"nan.pt: 1 tensor.*{name}.*diverged"):
        speechattn.load_upstream(tmp_path / "nan.pt")


def test_step_sampler_is_a_function_of_seed_and_batch_number():
    def batches(**kw):
        sampler = StepBatchSampler(
            **{"num_items": 10, "batch_size": 3, "total_batches": 9, "seed": 1, **kw}
        )
        return [sampler.batch(i) for i in range(kw.get("start", 0), 9)], list(sampler)

    full, keys = batches()
    resumed, resumed_keys = batches(start=4)
    assert resumed == full[4:] and resumed_keys == keys[4:]
    assert [[i for _, i in b] for b in keys] == full
    stream = [i for b in full for i in b]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert full != batches(seed=2)[0]
    ranks = [batches(num_items=12, batch_size=2, rank=r, world_size=2)[0] for r in (0, 1)]
    for a, b in zip(*ranks):
        assert not set(a) & set(b), "ranks see disjoint halves of a batch"
    assert len(StepBatchSampler(10, 3, total_batches=9, seed=1, start=4)) == 9


def test_length_buckets_group_similar_lengths_without_changing_the_items():
    lengths = list(range(100))
    plain = StepBatchSampler(100, 4, total_batches=25, seed=0)
    bucketed = StepBatchSampler(100, 4, total_batches=25, seed=0, lengths=lengths, bucket_size=5)
    for pool in range(5):  # a pool of 5 batches holds the same items, sorted into batches
        ids = range(pool * 5, pool * 5 + 5)
        assert sorted(i for k in ids for i in plain.batch(k)) == sorted(
            i for k in ids for i in bucketed.batch(k)
        )
    spread = sum(max(bucketed.batch(k)) - min(bucketed.batch(k)) for k in range(25))
    spread_plain = sum(max(plain.batch(k)) - min(plain.batch(k)) for k in range(25))
    assert spread < spread_plain / 3


def test_seeded_items_make_random_crops_reproducible():
    class RandomCrop(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return int(torch.randint(0, 1000, ()))

    items = SeededItems(RandomCrop())
    torch.manual_seed(0)
    a = [items[(7, 1)], items[(8, 1)]]
    torch.manual_seed(1)  # the global RNG state does not matter
    assert [items[(7, 1)], items[(8, 1)]] == a


def test_lr_schedule_warms_up_then_decays_linearly():
    f = [lr_factor(s, warmup=4, total=12) for s in range(12)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[8] == pytest.approx(0.5) and f[11] == pytest.approx(0.125)
    assert lr_factor(0, 0, 10) == 1.0


def test_unknown_names_give_hydra_errors_listing_the_choices(tmp_path):
    from hydra.errors import ConfigCompositionException

    for override, listed in (("attention=nope", "ldsa"), ("model=nope", "aalbert_base")):
        with pytest.raises(ConfigCompositionException) as e:
            compose_pretrain(tmp_path, *SYNTH, override)
        assert "Available options" in str(e.value) and listed in str(e.value)


def test_real_data_module_on_the_tiny_corpus(tmp_path, tiny_data_config):
    """The default data path (PretrainDataModule on a built-in corpus) learns and exports."""
    d = tiny_data_config
    cfg = compose_pretrain(
        tmp_path,
        f"data.root={d.root}",
        f"data.cache_dir={d.cache_dir}",
        "data.batch_size=8",
        "data.extract_workers=1",
        "data.shard_size=8",
        "data.progress=false",
        "model.net.dim=64",
        "model.net.num_heads=4",
        "model.net.ffn_dim=128",
        "model.optimizer.lr=1e-2",
        "trainer.max_steps=60",
        "trainer.val_check_interval=10",
        "data.pretrain_val_fraction=0.2",
    )
    result = run(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    val = [r["val_loss"] for r in rows if not math.isnan(r["val_loss"])]
    assert rows[0]["step"] == 0 and len(val) == 7  # the untrained model's val_loss comes first
    assert val[-1] < val[0] - 0.02 and min(val[1:]) < val[0], val
    up = speechattn.load_upstream(result["upstream"])
    assert up.metadata["corpus"] == "embedded" and up.feature_dim == 80
    assert up.metadata["data_summary"]["train_utterances"] > 0
    assert up.feature_config["n_mels"] == 80
    assert up.normalizer.mode == "global" and up.mean.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["~experiment"], {"model.net.dim": 768, "model.net.num_heads": 12,
                                  "model.net.ffn_dim": 3072, "model.net.num_layers": 6,
                                  "model.optimizer.name": "lamb", "model.optimizer.lr": 5e-5,
                                  "model.net.pre_norm": False, "model.net.dropout": 0.1,
                                  "model.net.position_scale": 1.0,
                                  "model.net.conv_position_kernel": 0,
                                  "model.masking.span": 7}),
        ([], {"model.name": "aalbert_tiny", "model.net.position_scale": 0.0,
              "model.net.conv_position_kernel": 15, "model.masking.span": 1}),
        (["trainer=gpu"], {"trainer.accelerator": "gpu", "trainer.precision": "bf16-mixed"}),
        (["trainer=ddp"], {"trainer.strategy": "ddp", "trainer.precision": "auto"}),
        (["experiment=paper"], {"data.corpus": "librispeech", "data.batch_size": 50,
                                "trainer.max_steps": 500000, "model.name": "aalbert_base",
                                "trainer.precision": "bf16-mixed"}),
        (["debug=fdr"], {"trainer.max_steps": 5}),
        (["model.net.shared=false", "model.optimizer.name=adamw"], {"model.net.shared": False}),
    ],
)  # fmt: skip
def test_config_groups_compose(tmp_path, overrides, expected):
    from omegaconf import OmegaConf

    cfg = compose_pretrain(tmp_path, *overrides, shrink=False)
    for key, value in expected.items():
        assert OmegaConf.select(cfg, key) == value, key


def test_precision_auto_is_fp32_on_cpu():
    from speechattn.tasks.pretrain.run import resolve_precision

    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", "cpu") == "32-true"
    assert resolve_precision("32-true", "cpu") == "32-true"


def test_crafted_checkpoints_never_run_code(tmp_path, crafted_torch_file):
    """export_upstream and resuming read checkpoints with weights_only=True: a pickle that
    calls os.system is refused, naming the file, and the command never runs."""
    from speechattn.model.serialization import TorchFileError

    run(
        compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=4"),
        datamodule=SyntheticPretrainData(),
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(last) == []  # nothing to allow
    marker = crafted_torch_file(last, torch.load(last, weights_only=True))
    with pytest.raises(TorchFileError, match="refused to unpickle") as info:
        export_upstream(last, tmp_path / "exported.pt")
    assert str(last) in str(info.value) and not (tmp_path / "exported.pt").exists()
    with pytest.raises(TorchFileError, match="refused to unpickle") as info:
        run(
            compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=8", "ckpt_path=last"),
            datamodule=SyntheticPretrainData(),
        )
    assert str(last) in str(info.value) and "ckpt_path=" in str(info.value)
    assert not marker.exists()


def test_truncated_last_checkpoint_names_it_and_the_newest_intact_one(tmp_path):
    from speechattn.model.serialization import TorchFileError

    steps = ("trainer.max_steps=8", "checkpoint.every_n_steps=4")
    run(compose_pretrain(tmp_path, *SYNTH, *steps), datamodule=SyntheticPretrainData())
    ckpts = tmp_path / "checkpoints"
    last, newest = ckpts / "last.ckpt", ckpts / "step=0000008.ckpt"
    last.write_bytes(last.read_bytes()[:5000])
    newest.write_bytes(newest.read_bytes()[:100])  # the newest periodic one is damaged too
    with pytest.raises(TorchFileError) as info:
        run(
            compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=12", "ckpt_path=last"),
            datamodule=SyntheticPretrainData(),
        )
    message = str(info.value)
    assert str(last) in message and "truncated or corrupt" in message
    # quoted for Hydra's parser (`=` in the name): test_resume.py pastes one
    pasted = "\"ckpt_path='" + str(ckpts / "step=0000004.ckpt") + "'\""
    assert f"(step 4): {pasted}" in message


def test_crop_beyond_the_attention_limit_fails_before_training(tmp_path):
    """syn_random with max_len 100 model frames takes 300 input frames; data.max_frames=1500
    used to fail at the first long batch."""
    cfg = compose_pretrain(tmp_path, "attention=syn_random", "attention.options.max_len=100")
    with pytest.raises(
        ValueError, match="data.max_frames=1500.*syn_random accepts: 300 input"
    ) as e:
        run(cfg, datamodule=SyntheticPretrainData())
    assert "attention.options.max_len>=500" in str(e.value)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_adaptive_span_penalty_joins_the_training_loss(tmp_path, penalty):
    """The task adds the span penalty (once for the shared layer) to the loss it optimises:
    a large one shrinks the spans that reconstruction alone lengthens (Adam: ~lr per step)."""
    cfg = compose_pretrain(
        tmp_path, *SYNTH, "attention=adaptive_span", f"attention.options.span_penalty={penalty}"
    )
    run(cfg, datamodule=SyntheticPretrainData())
    task = PretrainTask.load_from_checkpoint(
        str(tmp_path / "checkpoints" / "last.ckpt"), map_location="cpu", weights_only=True
    )
    spans = task.model.encoder.layers[0].attention.spans()  # init: S / 4 + 1/2 = 64.5 frames
    torch.testing.assert_close(task.auxiliary_loss(), penalty * spans.mean())
    assert (spans < 64.5).all() if penalty else (spans != 64.5).all()  # learned either way
    assert len(train_losses(tmp_path / "metrics.csv")) >= 3


def test_adaptive_spans_are_projected_into_range_after_each_step(tmp_path):
    """A penalty far above the reconstruction gradient drives every span to 0, where the
    projection after each optimiser step (the paper's clamp) holds it."""
    cfg = compose_pretrain(
        tmp_path, *SYNTH, "attention=adaptive_span", "attention.options.span_penalty=10",
        "model.optimizer.lr=0.2", "model.optimizer.warmup_steps=0",
    )  # fmt: skip
    run(cfg, datamodule=SyntheticPretrainData())
    task = PretrainTask.load_from_checkpoint(
        str(tmp_path / "checkpoints" / "last.ckpt"), map_location="cpu", weights_only=True
    )
    assert (task.model.encoder.layers[0].attention.span_fraction == 0).all()


def test_no_auxiliary_loss_without_a_variant_that_has_one(tmp_path):
    cfg = compose_pretrain(tmp_path, *SYNTH, "trainer.max_steps=1")
    run(cfg, datamodule=SyntheticPretrainData())
    task = PretrainTask.load_from_checkpoint(
        str(tmp_path / "checkpoints" / "last.ckpt"), map_location="cpu", weights_only=True
    )
    assert task.auxiliary_loss() is None
