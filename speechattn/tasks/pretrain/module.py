"""Masked-reconstruction pretraining of AALBERT as a LightningModule: stack frames, corrupt
spans (`model/masking.py`, done by the loader for training batches), encode, reconstruct, L1
on the chosen frames. Every micro-batch reseeds dropout from (seed, step, micro-batch, rank),
so a resumed run matches an uninterrupted one. One host-device sync per step (`check_step`).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from speechattn.attention import Attention, autotune
from speechattn.data.features import Normalizer
from speechattn.errors import SpeechattnError
from speechattn.model.aalbert import AALBERT, ModelConfig
from speechattn.model.masking import MaskedBatch, MaskingConfig, corrupt, reconstruction_loss
from speechattn.model.optim import OptimConfig, build_optimizer, build_scheduler
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.model.upstream import nonfinite_tensors, save_upstream, upstream_state
from speechattn.tasks.common import host_value
from speechattn.tasks.pretrain.compiled import compile_objective
from speechattn.tasks.pretrain.data import BatchMasker
from speechattn.utils import derive_seed


class NonFiniteWarning(UserWarning):
    """A training step produced a NaN/inf loss or gradient and was skipped."""


class NonFiniteLossError(SpeechattnError, RuntimeError):
    """Too many non-finite steps in a row: training cannot recover by skipping."""


class PretrainTask(L.LightningModule):
    """AALBERT + masked acoustic modelling. Batches: `features` (B, T, F) normalised log-mel
    at 10 ms, `lengths` (B,) (or the loader's `masked`). `data_info` holds what upstream.pt
    needs of the data (normaliser, feature settings, corpus) and travels in every checkpoint."""

    def __init__(
        self,
        model: dict[str, Any],
        masking: dict[str, Any] | None = None,
        optimizer: dict[str, Any] | None = None,
        total_steps: int = 1000,
        seed: int = 0,
        max_nonfinite: int = 5,
        compile: bool = False,
        compile_mode: str = "default",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig(**model)
        self.masking = MaskingConfig(**(masking or {}))
        self.optim = OptimConfig(**(optimizer or {}))
        self.total_steps = int(total_steps)
        self.seed = int(seed)
        self.max_nonfinite = int(max_nonfinite)
        self.model = AALBERT(self.model_config)
        self.data_info: dict[str, Any] = {}
        self._compiled = compile_objective(self.model, compile_mode) if compile else None
        # `allow_resume_changes`' changes, {"step", "setting", "checkpoint", "now"} each
        self.resume_changes: list[dict[str, Any]] = []
        self._nonfinite_in_row = 0
        self._skipped_this_step = False
        self._micro = (-1, 0)  # (global_step, micro-batch index within the accumulation)
        self._last_time: float | None = None
        self._last_frames = 0
        # the step's checks on the device, read once per step (on_before_optimizer_step)
        self._loss_finite: Tensor | None = None  # () bool, all micro-batches' losses finite
        self._step_loss: tuple[Tensor, int] | None = None  # (loss (), chosen frames) to log
        self._params_finite: tuple[Tensor, int] | None = None  # (() bool, step) after an update
        self._train_loss: Tensor | float | None = None  # of the last step that trained

    @property
    def last_train_loss(self) -> float | None:
        """Loss of the last step that trained (metadata), read from the device when asked."""
        return None if self._train_loss is None else float(self._train_loss)

    def setup(self, stage: str) -> None:
        if self.trainer.strategy.root_device.type == "cuda":
            # TF32 for fp32 regions (key selection stays fp32: attention/fp32.py); not per-backend
            # fp32_precision attributes, which make get_float32_matmul_precision() raise
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        # the data module's setup, which computes the normaliser, has run
        dm = self.trainer.datamodule if self._trainer is not None else None
        norm = getattr(dm, "normalizer", None)
        if norm is not None:
            self.data_info["normalizer"] = norm.state_dict()
        describe = getattr(dm, "describe", None)
        if callable(describe):  # corpus root, utterance counts, skips
            self.data_info["data_summary"] = describe()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_parameters()  # never keep weights the last update made NaN/inf
        checkpoint["speechattn_data"] = self.data_info
        checkpoint["speechattn_train_loss"] = self.last_train_loss

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # before Lightning restores the optimiser and schedule from `checkpoint`: edits count
        saved = checkpoint.get("speechattn_data", {}) or {}
        history = [*saved.get("resume_changes", []), *self.resume_changes]
        if any(c["setting"].startswith("data.") for c in self.resume_changes):
            saved = {k: v for k, v in saved.items() if k not in ("normalizer", "feature_config")}
        self.data_info = {**saved, **self.data_info}
        if history:
            self.data_info["resume_changes"] = history
        self._train_loss = checkpoint.get("speechattn_train_loss", self._train_loss)
        if any(c["setting"].startswith("model.optimizer.") for c in self.resume_changes):
            self._apply_optimizer_settings(checkpoint)

    def _apply_optimizer_settings(self, checkpoint: dict[str, Any]) -> None:
        """Put this run's lr, betas, eps and weight decay into the checkpoint's optimiser and
        schedule state, which would otherwise keep the old values (the schedule's shape is this
        run's anyway: its state keeps only the step)."""
        for state in checkpoint.get("optimizer_states", []):
            for index, group in enumerate(state["param_groups"]):
                base = group.get("initial_lr", group["lr"])
                group["lr"] = group["lr"] * self.optim.lr / base  # the same point of the schedule
                group["initial_lr"] = self.optim.lr
                group["betas"] = tuple(self.optim.betas)
                group["eps"] = self.optim.eps
                if index == 0:  # parameter_groups: the decayed matrices first, then the rest
                    group["weight_decay"] = self.optim.weight_decay
        for state in checkpoint.get("lr_schedulers", []):
            if "base_lrs" in state:
                state["_last_lr"] = [
                    lr * self.optim.lr / base
                    for lr, base in zip(state["_last_lr"], state["base_lrs"])
                ]
                state["base_lrs"] = [self.optim.lr] * len(state["base_lrs"])

    def batch_masker(self, pad_to_multiple: int = 1) -> BatchMasker:
        """The host side of a training step (stack, length buckets, mask), run by the loader."""
        stack, limit = self.model_config.stack, self.model.max_input_frames
        max_model_frames = None if limit is None else limit // stack
        return BatchMasker(
            stack, self.masking, pad_to_multiple=pad_to_multiple, max_model_frames=max_model_frames
        )

    def reconstruction_loss(
        self, batch: dict[str, Any], generator: torch.Generator
    ) -> tuple[Tensor, int, int]:
        """Masked L1 of one batch, its valid 10 ms frames and its chosen model frames (host
        counts: no sync). A batch without the loader's `masked` is masked with `generator`."""
        masked: MaskedBatch | None = batch.get("masked")
        if masked is None:
            masked = corrupt(
                self.model, batch["features"], batch["lengths"], self.masking, generator
            )
        if self._compiled is not None and self.training:  # validation stays eager
            loss = self._compiled(masked)
        else:
            loss = reconstruction_loss(self.model, masked)
        frames = sum(batch["lengths"].tolist())  # host lengths read as such: no tensor op
        return loss, frames, masked.num_chosen

    def _seed_micro_batch(self) -> torch.Generator:
        """Reseed dropout (and masking of an unmasked batch) from (seed, step, micro, rank)."""
        step = self.global_step
        micro = self._micro[1] + 1 if self._micro[0] == step else 0
        self._micro = (step, micro)
        s = derive_seed(self.seed, "train", step, micro, self.global_rank)
        torch.manual_seed(s)  # dropout (also seeds CUDA generators)
        return torch.Generator().manual_seed(s ^ 0x5DEECE66D)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, frames = self.step_loss(batch)
        # frames_per_s: the previous step's valid 10 ms frames, all ranks, over its duration
        now = time.perf_counter()
        if self._last_time is not None and now > self._last_time:
            fps = self._last_frames / (now - self._last_time) * self.trainer.world_size
            self.log("frames_per_s", host_value(fps), prog_bar=True, on_step=True, batch_size=1)
        self._last_time, self._last_frames = now, frames
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            self.log("lr", host_value(scheduler.get_last_lr()[0]), on_step=True, batch_size=1)
        return loss  # backward runs even when it is not finite; the update is then skipped

    def step_loss(self, batch: dict[str, Any]) -> tuple[Tensor, int]:
        """A training micro-batch up to backward: its loss (with the attention's auxiliary
        loss; finite check queued on the device) and its valid 10 ms frames."""
        generator = self._seed_micro_batch()
        loss, frames, chosen = self.reconstruction_loss(batch, generator)
        finite = torch.isfinite(loss.detach())  # () bool, stays on the device for check_step
        if self._micro[1] == 0 or self._loss_finite is None:
            self._skipped_this_step = False
            self._loss_finite = finite
        else:
            self._loss_finite = self._loss_finite & finite
        # a batch of very short utterances may have nothing to reconstruct (loss 0): not logged
        self._step_loss = (loss.detach(), chosen) if chosen else None
        aux = self.auxiliary_loss()
        if aux is not None:  # adaptive_span's span penalty; train_loss stays reconstruction
            self.log("aux_loss", aux, on_step=True, batch_size=1)
            loss = loss + aux
        return loss, frames

    def check_step(self) -> bool:
        """The step's one host read: whether the losses, the gradient norm and the previous
        update's parameters are finite, with the loss and the norm (logged as host values).
        Not finite: grads dropped (returns False, update skipped); `NonFiniteLossError` for
        parameters, or after `max_nonfinite` skipped steps in a row."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads and self._loss_finite is None:
            return False
        like = self._loss_finite if self._loss_finite is not None else grads[0]
        one = torch.ones((), device=like.device)  # a stand-in filled on the device: no copy
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else one
        loss = self._step_loss[0] if self._step_loss is not None else one
        loss_finite = self._loss_finite if self._loss_finite is not None else one
        params_finite = self._params_finite[0] if self._params_finite is not None else one
        values = [loss_finite, torch.isfinite(norm), params_finite, loss, norm]  # () on the device
        read = torch.stack([v.float() for v in values]).tolist()
        loss_ok, grad_ok, params_ok, loss_value, norm_value = read
        self._loss_finite = None
        if not params_ok:
            self._raise_diverged(self._params_finite[1])  # type: ignore[index]
        self._params_finite = None
        if loss_ok and grad_ok:
            if not self._skipped_this_step:
                self._nonfinite_in_row = 0
            if self._step_loss is not None:
                value, chosen = host_value(loss_value), self._step_loss[1]
                self.log("train_loss", value, prog_bar=True, on_step=True, batch_size=chosen)
                # kept here: callback_metrics lose step-only values when validate() runs after fit
                self._train_loss = loss_value
            return True
        for p in self.parameters():  # gradients are all-reduced: every rank skips together
            p.grad = None
        self._skipped_this_step = True
        self._nonfinite_in_row += 1
        loss_text = loss_value if self._step_loss is not None else float("nan")
        what = f"loss {loss_text}" if not loss_ok else f"gradient norm {norm_value}"
        warnings.warn(
            f"step {self.global_step}: non-finite {what}; "
            f"skipping this update ({self._nonfinite_in_row}/{self.max_nonfinite} in a row)",
            NonFiniteWarning,
            stacklevel=2,
        )
        if self._nonfinite_in_row >= self.max_nonfinite:
            raise NonFiniteLossError(
                f"training stopped at step {self.global_step}: {self._nonfinite_in_row} "
                f"non-finite losses/gradients in a row (limit max_nonfinite="
                f"{self.max_nonfinite}). {self.divergence_advice()}"
            )
        return False

    def check_parameters(self) -> None:
        """`NonFiniteLossError` when the last update made parameters NaN/inf (a sync)."""
        if self._params_finite is not None and not bool(self._params_finite[0]):
            self._raise_diverged(self._params_finite[1])

    def _raise_diverged(self, step: int) -> None:
        # a finite loss and gradient can still overflow the weights (lr far too high)
        bad = nonfinite_tensors(dict(self.model.named_parameters()))
        raise NonFiniteLossError(
            f"training diverged at step {step}: the update made {len(bad)} "
            f"parameter tensor(s) NaN/inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
            f"no upstream.pt is written. {self.divergence_advice()}"
        )

    def auxiliary_loss(self) -> Tensor | None:
        """Sum of the attention modules' `auxiliary_loss()`, each (shared) module once."""
        terms = [m.auxiliary_loss() for m in self.model.modules() if isinstance(m, Attention)]
        terms = [t for t in terms if t is not None]
        return torch.stack(terms).sum() if terms else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.check_step()  # before clipping and the update

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.after_update()

    def after_update(self) -> None:
        """After an update: adaptive_span's spans back into [0, S]; the parameters' finite
        check queued on the device (read by the next `check_step`, `check_parameters`)."""
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.after_optimizer_step()
        params = [p.detach() for p in self.model.parameters()]
        # max |p| is NaN/inf exactly when some element is (a 2-norm overflows for huge weights)
        finite = torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf")))).all()
        self._params_finite = (finite, self.global_step)

    def divergence_advice(self) -> str:
        """What to change after a divergence; resuming only if a checkpoint exists."""
        lr = self.optim.lr
        advice = (
            f"Try a smaller learning rate, e.g. model.optimizer.lr={lr / 10:g} (now {lr:g}), a "
            f"longer warm-up (model.optimizer.warmup_fraction), gradient clipping "
            f"(trainer.gradient_clip_val), fp32 instead of mixed precision, or check the "
            f"features for NaN/inf."
        )
        callback = self.trainer.checkpoint_callback if self._trainer is not None else None
        folder = getattr(callback, "dirpath", None)
        last = Path(folder) / "last.ckpt" if folder else None
        if last is not None and last.is_file():
            advice += (
                f" The last checkpoint, {last}, resumes with ckpt_path=last; with a smaller lr "
                f"add allow_resume_changes=[model.optimizer.lr] (docs/preemption.md)."
            )
        return advice

    def check_converged(self, val_loss: float | None = None) -> None:
        """`NonFiniteLossError` when the last update made the weights NaN/inf, training ended
        inside a streak of skipped steps, or the final validation loss `val_loss` is NaN/inf."""
        self.check_parameters()
        if self._nonfinite_in_row:
            raise NonFiniteLossError(
                f"training diverged: its last {self._nonfinite_in_row} step(s), up to step "
                f"{self.global_step}, had non-finite losses/gradients and were skipped; no "
                f"upstream.pt is written. {self.divergence_advice()}"
            )
        if val_loss is not None and not math.isfinite(val_loss):
            raise NonFiniteLossError(
                f"the final validation loss is {val_loss} at step {self.global_step}: the model "
                f"diverged or the validation features hold NaN/inf; no upstream.pt is written. "
                f"{self.divergence_advice()}"
            )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        # fixed masks per batch: val_loss comparable across the run; weighted by chosen frames
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "val", batch_idx))
        loss, _, chosen = self.reconstruction_loss(batch, generator)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=max(chosen, 1))
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self, self.optim)
        scheduler = build_scheduler(optimizer, self.optim, self.total_steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def upstream_metadata(self) -> dict[str, Any]:
        from speechattn import code_version

        # the normaliser and feature settings have their own entries in upstream.pt
        skip = ("mean", "std", "feature_config", "normalizer")
        info = {k: v for k, v in self.data_info.items() if k not in skip}
        trainer = self._trainer
        return {
            "steps": int(self.global_step),
            "total_steps": self.total_steps,
            "seed": self.seed,
            "code_version": code_version(),
            "attention": self.model_config.attention,
            "attention_options": dict(self.model_config.attention_options),
            "kernels": autotune.choices(self.model),  # measured or by rule (attention.autotune)
            "masking": asdict(self.masking),
            "optimizer": {**asdict(self.optim), "betas": list(self.optim.betas)},
            "world_size": trainer.world_size if trainer is not None else 1,
            "num_params": self.model.get_num_params(include_head=False),
            "train_loss": self.last_train_loss,
            **info,
        }

    def export_upstream(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write `upstream.pt` for the current weights."""
        norm = self.data_info.get("normalizer")  # None: data given pre-normalised
        dim = self.model_config.feature_dim
        normalizer = Normalizer.identity(dim) if norm is None else Normalizer.from_state_dict(norm)
        features = self.data_info.get("feature_config", {})
        metadata = {**self.upstream_metadata(), **(extra or {})}
        return save_upstream(path, upstream_state(self.model, normalizer, features, metadata))


def export_upstream(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `upstream.pt` from a Lightning checkpoint of a pretraining run (e.g. a periodic
    one), read with `weights_only=True`; `TorchFileError` naming a file that is unreadable or
    not a pretraining checkpoint."""
    ckpt = load_torch_file(checkpoint, "cpu", "pretraining checkpoint")
    try:
        task = PretrainTask(**ckpt["hyper_parameters"])
        task.load_state_dict(ckpt["state_dict"])
    except Exception as e:  # another module's checkpoint, or missing/mismatched weights
        raise TorchFileError(
            f"pretraining checkpoint {checkpoint}: not a checkpoint of `python -m "
            f"speechattn.pretrain` ({type(e).__name__}: {str(e)[:200]})"
        ) from e
    task.data_info = ckpt.get("speechattn_data", {})
    extra = {"steps": int(ckpt.get("global_step", 0)), "checkpoint": str(checkpoint)}
    return task.export_upstream(out, extra)
