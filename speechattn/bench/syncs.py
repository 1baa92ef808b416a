"""Count host-device synchronisations: reads of device data by the host, and uploads of host
memory that block it (docs/gpu.md, "One host read and no blocking upload per training step").

With `cpu_is_device=True` (a CPU-only machine) every CPU tensor counts as device data except
declared host data (`host=`), tensors made from Python data and what is computed from host data
only, so a CPU run shows the syncs a GPU step would make as far as both take the same branches.
All copies are CPU to CPU there, so only what plainly makes device data of host data counts as
an upload: `torch.tensor` / `torch.as_tensor` with a `device=` other than "cpu", `.to(t)` for a
device tensor t, `.copy_` of host data into device data.

    with SyncCounter(host=[lengths]) as syncs:
        step()
    syncs.count, syncs.reasons  # reads: Counter of "_local_scalar_dense" etc.
    syncs.upload_count, syncs.uploads  # uploads: Counter of "h2d_pageable", "h2d_blocking"
"""

from __future__ import annotations

import contextlib
import functools
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten

# ops that read device data on the host: their result is a Python scalar
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
# ops whose output shape depends on the data: the host must learn the size
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
# the reasons of uploads: from pageable memory (always blocks), from pinned memory blocking
PAGEABLE, BLOCKING = "h2d_pageable", "h2d_blocking"


def _bool_index(func: Any, args: tuple) -> bool:
    """aten.index / index_put with a boolean mask: a nonzero inside."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(
        isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()
    )


def _is_pinned(t: Tensor) -> bool:
    """`t.is_pinned()`, False where it cannot be asked (fake tensors, no CUDA runtime)."""
    try:
        return bool(t.is_pinned())
    except Exception:  # noqa: BLE001 - any failure: not known to be pinned
        return False


def _names_device(device: Any) -> bool:
    """Whether a `device` argument names the device in a CPU stand-in run: not None, not "cpu"."""
    return device is not None and not (isinstance(device, str) and device.startswith("cpu"))


class SyncCounter(TorchDispatchMode):
    """Count host reads of device data and blocking uploads of host memory while active.
    `host`: host data (reads of it and of what is computed from it alone are free); `pinned`:
    host tensors taken as pinned where `is_pinned()` cannot tell (fake tensors, a CPU-only
    machine); `cpu_is_device=False` on a GPU, where CPU tensors are host data; `trace`: record
    where each sync comes from in `where` (`_caller`)."""

    # flex_attention & co. come through `__torch_dispatch__`, run uncounted there
    supports_higher_order_operators = True

    def __init__(
        self,
        host: Iterable[Tensor] = (),
        pinned: Iterable[Tensor] = (),
        cpu_is_device: bool = True,
        trace: bool = False,
    ) -> None:
        super().__init__()
        self.cpu_is_device, self.trace = cpu_is_device, trace
        self.where: Counter[str] = Counter()  # with trace: "reason at file:line" of our code
        self._host = WeakTensorKeyDictionary(dict.fromkeys(host, True))
        self._pinned = WeakTensorKeyDictionary(dict.fromkeys(pinned, True))
        self.reasons: Counter[str] = Counter()  # reads of device data
        self.uploads: Counter[str] = Counter()  # copies of host memory that block the host
        self._patched: list[tuple[Any, str, Any]] = []
        self._reading = 0  # inside a counted `.tolist()`: its copy to the host is the same read

    def _count(self, reason: str, upload: bool = False) -> None:
        (self.uploads if upload else self.reasons)[reason] += 1
        if self.trace:
            self.where[f"{reason} at {_caller()}"] += 1

    @property
    def count(self) -> int:
        """Reads of device data by the host."""
        return sum(self.reasons.values())

    @property
    def upload_count(self) -> int:
        """Copies of host memory to the device that block the host."""
        return sum(self.uploads.values())

    def _active(self) -> bool:
        """Whether this mode is on the dispatch stack (not popped inside a higher-order op):
        the patched Python entries count only then."""
        return any(m is self for m in _get_current_dispatch_mode_stack())

    def is_device(self, t: Tensor) -> bool:
        """Whether reading `t` on the host would wait for a device."""
        if t.device.type == "meta":
            return False
        if t.device.type != "cpu":
            return True
        return self.cpu_is_device and t not in self._host

    def _upload(self, src: Tensor, non_blocking: bool) -> None:
        """Count a copy of host tensor `src` to the device, unless it is pinned and async."""
        pinned = src in self._pinned or _is_pinned(src)
        if not (pinned and non_blocking):
            self._count(BLOCKING if pinned else PAGEABLE, upload=True)

    def _copies(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Count the copies between host and device that `func` makes."""
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            src, dst = args[0].device.type, torch.device(kwargs["device"]).type
            if dst == "cpu" and src != "cpu" and not self._reading:
                self._count("to_cpu")
            elif src == "cpu" and dst not in ("cpu", "meta"):
                self._upload(args[0], bool(kwargs.get("non_blocking", False)))
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if dst.device.type == "cpu" and src.device.type not in ("cpu", "meta"):
                if not non_blocking and not self._reading:
                    self._count("to_cpu")
            elif src.device.type == "cpu" and not self.is_device(src) and self.is_device(dst):
                self._upload(src, non_blocking)  # on a GPU, or host data into the stand-in

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            # inside uncounted: under a dispatch mode Flex runs torch's eager math (which uploads
            # its -inf fill), not the fused kernel a step runs, where a host read cannot hide
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        on_device = [t for t in tensors if self.is_device(t)]
        if on_device:
            if func in _SCALAR_READS or func in _DATA_DEPENDENT or _bool_index(func, args):
                self._count(str(func.overloadpacket.__name__))
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self._count("repeat_interleave")
        self._copies(func, args, kwargs)
        out = func(*args, **kwargs)
        # computed from host data only, or made from Python data: host data too
        if (tensors and not on_device) or func is aten.lift_fresh.default:
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self._host[t] = True
        return out

    # Python-level entries: reads without an aten op (or no-ops on the CPU), and, in the
    # stand-in, uploads whose copy is a no-op on the CPU
    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Replace `owner.name` by `wrapper(original, *args, **kwargs)` until `__exit__`."""
        original = getattr(owner, name)
        self._patched.append((owner, name, original))
        setattr(owner, name, lambda *args, **kwargs: wrapper(original, *args, **kwargs))

    def _read(self, name: str, original: Any, t: Tensor, *args: Any, **kwargs: Any) -> Any:
        # .cpu() of a GPU tensor is counted as its _to_copy
        copied = name == "cpu" and t.device.type != "cpu"
        counted = self._active() and self.is_device(t) and not copied
        if counted:
            self._count(name)
        self._reading += counted
        try:
            return original(t, *args, **kwargs)
        finally:
            self._reading -= counted

    def _stand_in_to(self, original: Any, t: Tensor, *args: Any, **kwargs: Any) -> Any:
        other = kwargs.get("other", args[0] if args else None)  # `t.to(other)`
        moved = isinstance(other, Tensor) and self.is_device(other)
        if moved and self._active() and not self.is_device(t):
            self._upload(t, bool(kwargs.get("non_blocking", False)))
            out = original(t, *args, **kwargs)
            self._host.pop(out, None)  # device data from here on
            return out
        return original(t, *args, **kwargs)

    def _stand_in_factory(self, original: Any, data: Any, *args: Any, **kwargs: Any) -> Tensor:
        out = original(data, *args, **kwargs)
        if self._active() and _names_device(kwargs.get("device")):
            if not isinstance(data, Tensor) or not self.is_device(data):
                self._count(PAGEABLE, upload=True)  # Python data is never pinned
            self._host.pop(out, None)  # device data from here on
        return out

    def __enter__(self) -> SyncCounter:
        for name in ("tolist", "numpy", "cpu"):
            self._patch(Tensor, name, functools.partial(self._read, name))
        if self.cpu_is_device:
            self._patch(Tensor, "to", self._stand_in_to)
            for name in ("tensor", "as_tensor"):
                self._patch(torch, name, self._stand_in_factory)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def summary(self) -> str:
        """`N syncs (reason xn, ...), M uploads (reason xm)`."""

        def part(n: int, what: str, reasons: Counter[str]) -> str:
            each = ", ".join(f"{k} x{v}" for k, v in reasons.most_common())
            return f"{n} {what}" + (f" ({each})" if each else "")

        text = part(self.count, "syncs", self.reasons)
        if self.uploads:
            text += ", " + part(self.upload_count, "uploads", self.uploads)
        return text


def _caller() -> str:
    """Where a sync comes from: `file:line` of the innermost frame in speechattn (not this
    module), else of the innermost one outside torch (e.g. Lightning's, or a test's)."""
    package = str(Path(__file__).parents[1]) + "/"
    frames = [f for f in traceback.extract_stack() if f.filename != __file__]
    ours = [f for f in frames if f.filename.startswith(package)]
    others = [f for f in frames if "/torch/" not in f.filename]
    if ours:
        return f"{ours[-1].filename[len(package) :]}:{ours[-1].lineno}"
    if others:
        return f"{others[-1].filename.rsplit('/site-packages/', 1)[-1]}:{others[-1].lineno}"
    return "?"


def train_step(
    task: Any, optimizer: torch.optim.Optimizer, data: dict[str, Any], bf16: bool = False
) -> Tensor:
    """One training step of `task` (a `PretrainTask`) as Lightning's loop runs it, without a
    Trainer (`bf16`: CUDA bf16 autocast, as `trainer.precision=bf16-mixed`); the update always
    runs, as Lightning's does (a skipped step has no gradients). Returns the loss, detached."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            loss, _ = task.step_loss(data)
        loss.backward()
        task.check_step()
        optimizer.step()
        task.after_update()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def pretrain_step_syncs(
    model: dict[str, Any], batch: int, frames: int, device: str = "cpu", steps: int = 1
) -> SyncCounter:
    """Syncs of the last of `steps` `train_step`s of a `PretrainTask` with `model`'s
    `ModelConfig` fields on `batch` utterances of `frames` model frames, the second 10 frames
    shorter (the padded path); the loader's host side (`batch_masker`) is not counted. From the
    second step on, the previous update's check is read too, in the same read."""
    from speechattn.model.optim import build_optimizer
    from speechattn.tasks.pretrain.module import PretrainTask

    torch.manual_seed(0)
    task = PretrainTask(model=model, optimizer={"name": "lamb", "lr": 1e-3}).to(device).train()
    optimizer = build_optimizer(task, task.optim)
    stack, F = task.model_config.stack, task.model_config.feature_dim
    lengths = torch.full((batch,), frames * stack)
    lengths[1:2] -= 10 * stack  # 10 ms frames, on the host as the loader gives them
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        features = torch.randn(batch, frames * stack, F, generator=g)
        features[torch.arange(frames * stack)[None, :] >= lengths[:, None]] = 0.0
        masked = task.batch_masker()(features, lengths, seed=step)
        if device != "cpu":
            masked = masked.pin_memory()  # as the loader does on a GPU
        masked = masked.to(device)  # non-blocking; its lengths stay on the host
        host = [lengths, masked.lengths]  # masked.lengths: pinned by the loader (a CPU cannot)
        counter = SyncCounter(host=host, pinned=[masked.lengths], cpu_is_device=device == "cpu")
        with counter if step == steps - 1 else contextlib.nullcontext():
            train_step(task, optimizer, {"masked": masked, "lengths": lengths})
    return counter


__all__ = ["SyncCounter", "pretrain_step_syncs", "train_step"]
