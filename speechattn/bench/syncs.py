"""Count host-device synchronisations: reads of device data by the host.

On a GPU every such read (`.item()`, `int(t)`, `bool(t)`, `float(t)`, `.tolist()`, `.cpu()`,
`.numpy()`, and ops whose output size depends on the data: `nonzero`, boolean indexing,
`masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`,
`torch.equal`) makes the host wait until the device has run everything queued before it; the
launch queue drains, and neither CUDA graphs nor a full-graph `torch.compile` can hold the
step. `SyncCounter` is a `TorchDispatchMode` that counts them, with the reason of each.

On a GPU, the device data is whatever lives off the CPU. On a CPU-only machine
(`cpu_is_device=True`) every CPU tensor counts as device data except the ones declared host
data (`host=`: the batch's lengths, which stay on the host on a GPU too) and whatever is
computed from host data only, so one CPU run shows the syncs a GPU step would make, as far
as the step takes the same branches on both (kernels chosen for the CPU may read lengths
that the CUDA branch bounds statically: count those on fake CUDA, `tests/fakecuda`).

    with SyncCounter(host=[lengths]) as syncs:
        step()
    syncs.count, syncs.reasons  # Counter of "aten._local_scalar_dense" etc.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
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


def _bool_index(func: Any, args: tuple) -> bool:
    """aten.index / index_put with a boolean mask: a nonzero inside."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(
        isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()
    )


class SyncCounter(TorchDispatchMode):
    """Count host reads of device data while active (see the module docstring).

    Args:
        host: tensors that are host data (e.g. lengths kept on the CPU); reads of them and of
            tensors computed from them alone are free.
        cpu_is_device: count CPU tensors (except host data) as device data: the CPU-only
            stand-in for a GPU run (default). False on a GPU, where CPU tensors are host data.
        trace: also record where each sync comes from (`where`: the innermost frame of the
            speechattn package).
    """

    def __init__(
        self, host: Iterable[Tensor] = (), cpu_is_device: bool = True, trace: bool = False
    ) -> None:
        super().__init__()
        self.cpu_is_device = cpu_is_device
        self.trace = trace
        self.where: Counter[str] = Counter()  # with trace: "reason at file:line" of our code
        self._host: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        for t in host:
            self.mark_host(t)
        self.reasons: Counter[str] = Counter()
        self._patched: dict[str, Any] = {}

    def _count(self, reason: str) -> None:
        self.reasons[reason] += 1
        if self.trace:
            import traceback

            frames = [
                f for f in traceback.extract_stack()[:-2]
                if "speechattn" in f.filename and not f.filename.endswith("syncs.py")
            ]  # fmt: skip
            at = f"{frames[-1].filename.rsplit('speechattn/', 1)[-1]}:{frames[-1].lineno}"
            self.where[f"{reason} at {at if frames else '?'}"] += 1

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def mark_host(self, t: Tensor) -> None:
        """Declare `t` host data."""
        self._host[t] = True

    def is_device(self, t: Tensor) -> bool:
        """Whether reading `t` on the host would wait for a device."""
        if t.device.type == "meta":
            return False
        if t.device.type != "cpu":
            return True
        return self.cpu_is_device and t not in self._host

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        on_device = [t for t in tensors if self.is_device(t)]
        if on_device:
            if func in _SCALAR_READS or func in _DATA_DEPENDENT or _bool_index(func, args):
                self._count(str(func.overloadpacket.__name__))
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self._count("repeat_interleave")
            elif func is aten._to_copy.default and kwargs.get("device") is not None:
                if torch.device(kwargs["device"]).type == "cpu" and tensors[0].device.type != "cpu":
                    self._count("to_cpu")
        out = func(*args, **kwargs)
        if tensors and not on_device:  # computed from host data only: host data too
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self._host[t] = True
        return out

    # Tensor methods that read memory without an aten op (or that are no-ops on the CPU)
    def _wrap(self, name: str) -> None:
        original = getattr(Tensor, name)
        counter = self

        def method(t: Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.is_device(t) and not (name == "cpu" and t.device.type != "cpu"):
                counter._count(name)  # .cpu() of a GPU tensor: counted as _to_copy
            return original(t, *args, **kwargs)

        self._patched[name] = original
        setattr(Tensor, name, method)

    def __enter__(self) -> SyncCounter:
        for name in ("tolist", "numpy", "cpu"):
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._patched.items():
            setattr(Tensor, name, original)
        self._patched.clear()

    def summary(self) -> str:
        """`N syncs (reason x n, ...)`."""
        parts = ", ".join(f"{k} x{v}" for k, v in self.reasons.most_common())
        return f"{self.count} syncs" + (f" ({parts})" if parts else "")


def pretrain_step_syncs(
    model: dict[str, Any], batch: int, frames: int, device: str = "cpu", steps: int = 1
) -> SyncCounter:
    """Syncs of a pretraining step as `PretrainTask` trains: the loader's host side
    (`batch_masker`: stacking, masking), then, counted, `step_loss`, backward, `check_step`,
    the LAMB update and `after_update`; `batch` utterances of `frames` model frames (the
    second one 10 frames shorter, so the step takes its padded path). Returns the counter of
    the last of `steps` steps (from the second on, the parameters' check of the previous
    update is read too, in the same read). On a CPU the CPU stands in for the device.

    Args:
        model: `ModelConfig` fields (`PretrainTask`'s `model`).
    """
    import warnings

    from speechattn.model.optim import build_optimizer
    from speechattn.tasks.pretrain.module import PretrainTask

    torch.manual_seed(0)
    task = PretrainTask(model=model, optimizer={"name": "lamb", "lr": 1e-3}).to(device).train()
    optimizer = build_optimizer(task, task.optim)
    stack, F = task.model_config.stack, task.model_config.feature_dim
    lengths = torch.full((batch,), frames * stack)
    lengths[1:2] -= 10 * stack  # 10 ms frames, on the host as the loader gives them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            features = torch.randn(batch, frames * stack, F, generator=g)
            features[torch.arange(frames * stack)[None, :] >= lengths[:, None]] = 0.0
            masked = task.batch_masker()(features, lengths, seed=step).to(device)
            data = {"masked": masked, "lengths": lengths}
            counter = SyncCounter(host=[lengths, masked.lengths], cpu_is_device=device == "cpu")
            with counter if step == steps - 1 else contextlib.nullcontext():
                loss, _ = task.step_loss(data)
                loss.backward()
                task.check_step()
                optimizer.step()  # as Lightning does: always (a skipped step has no grads)
                task.after_update()
                optimizer.zero_grad(set_to_none=True)
    return counter


__all__ = ["SyncCounter", "pretrain_step_syncs"]
