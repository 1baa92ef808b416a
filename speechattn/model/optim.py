"""The model's optimiser: parameter groups, LAMB / AdamW and the learning-rate schedule, for
pretraining, the head analysis and the benchmark alike. Weight decay applies to matrices only
(parameters of two or more dimensions), as in nanoGPT's `configure_optimizers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from speechattn.errors import is_int, is_number, require


@dataclass
class OptimConfig:
    name: str = "lamb"  # lamb (AALBERT, pytorch_optimizer.Lamb) | adamw (torch.optim.AdamW)
    lr: float = 5e-5  # the study's value for aalbert_base
    weight_decay: float = 0.01  # applied to matrices only (>= 2 dims), as in BERT / nanoGPT
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    warmup_fraction: float = 0.07  # linear warm-up over this share of the steps (Mockingjay)
    warmup_steps: int | None = None  # overrides warmup_fraction when set
    final_lr_fraction: float = 0.0  # linear decay from lr to lr * this at the last step

    def __post_init__(self) -> None:
        require(self.name in ("lamb", "adamw"), "model.optimizer.name", self.name, "lamb or adamw")
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        require(is_number(self.lr) and self.lr > 0, "model.optimizer.lr", self.lr, "> 0")
        ok = is_number(self.weight_decay) and self.weight_decay >= 0
        require(ok, "model.optimizer.weight_decay", self.weight_decay, ">= 0")
        ok = len(self.betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in self.betas)
        require(ok, "model.optimizer.betas", list(self.betas), "two numbers in [0, 1)")
        require(is_number(self.eps) and self.eps > 0, "model.optimizer.eps", self.eps, "> 0")
        for name in ("warmup_fraction", "final_lr_fraction"):
            value = getattr(self, name)
            ok = is_number(value) and 0 <= value <= 1
            require(ok, f"model.optimizer.{name}", value, "in [0, 1]")
        ok = self.warmup_steps is None or (is_int(self.warmup_steps) and self.warmup_steps >= 0)
        require(ok, "model.optimizer.warmup_steps", self.warmup_steps, "an integer >= 0, or null")

    def warmup(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return int(round(self.warmup_fraction * total_steps))


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters in two groups: matrices decayed; vectors (biases, norms) and those
    a submodule lists in `no_weight_decay` (matrices of per-head biases: relpos's u, v) not."""
    exempt = {
        id(getattr(sub, name))
        for sub in module.modules()
        for name in getattr(sub, "no_weight_decay", ())
        if getattr(sub, name, None) is not None
    }
    params = [p for p in module.parameters() if p.requires_grad]
    decays = {id(p): p.dim() >= 2 and id(p) not in exempt for p in params}
    return [
        {"params": [p for p in params if decays[id(p)]], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays[id(p)]], "weight_decay": 0.0},
    ]


def build_optimizer(module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """`cfg.name` over `parameter_groups(module, cfg.weight_decay)`."""
    groups = parameter_groups(module, cfg.weight_decay)
    if cfg.name == "lamb":
        from pytorch_optimizer import Lamb

        # foreach: one batched update over all tensors, with no host reads; the per-parameter
        # path reads each tensor's norms on the host (`weight_norm == 0`): 2 syncs a tensor
        return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, warmup: int, total: int, final: float = 0.0) -> float:
    """Multiplier of the peak LR at optimizer step `step`: linear warm-up, then linear decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 1.0 - (1.0 - final) * progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: `lr_factor` with `cfg`'s warm-up over `total_steps`."""
    warmup, final = cfg.warmup(total_steps), cfg.final_lr_fraction
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, final)
    )
