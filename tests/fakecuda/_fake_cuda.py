"""Run CUDA code paths without a GPU: fake CUDA tensors, CUDA autocast, a Python backward.

`torch._subclasses.fake_tensor.FakeTensorMode` makes tensors on device "cuda" that carry
shape, dtype, device and strides but no data; every op runs its meta kernel, so the CUDA
branches of our code run, with CUDA's dispatch (SDPA's CUDA kernels, autocast's CUDA rules).
What this proves and what it cannot:

* proved: every op accepts its inputs' devices, dtypes and shapes; outputs and gradients have
  the expected device, dtype and shape; nothing reads tensor data on the host: an `.item()`,
  `bool(t)`, `.tolist()`, `nonzero` or numpy call on device data raises here, which is how a
  host-device sync shows up; nothing calls the real CUDA runtime (it raises "Found no NVIDIA
  driver").
* not proved: numerics, speed, memory, kernel launch counts, and ops whose CUDA kernel is
  missing while their meta kernel exists (rare; the gpu suite, `pytest -m gpu`, runs them).

Three limits of torch 2.11 without a GPU are worked around here:

* `torch.autocast("cuda")` disables itself when CUDA is unavailable, so `cuda_autocast`
  switches CUDA autocast on through `torch.set_autocast_enabled` (the same state the context
  manager sets), and the dispatcher then applies CUDA's autocast rules to fake CUDA tensors.
* `Tensor.backward()` fails in the autograd engine on fake CUDA tensors (it asks the CUDA
  driver for a device context), so `backward` walks the autograd graph in Python, calling
  each node's backward function directly, which runs the very same backward formulas
  (including custom autograd Functions' `backward`).
* FlexAttention (`fake_flex`): its autograd differentiates the score_mod through the autograd
  engine on scalars of the query's device, which needs a CUDA context ("hasPrimaryContext
  expects a valid device index"), so that joint graph is traced on CPU scalars instead (the
  same elementwise graph); and inductor needs a real device to generate code, so the Flex
  call compiles with the "eager" backend (dynamo still traces it, as on a GPU).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import defaultdict
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = torch.device("cuda")


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake tensors on device "cuda"; real (CPU) tensors may enter as constants."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """CUDA autocast to `dtype` (None: off), which `torch.autocast("cuda")` refuses without
    a GPU."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", dtype is not None)
    if dtype is not None:
        torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def fake_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let FlexAttention trace forward and backward on fake CUDA tensors (module docstring):
    the score_mod's joint graph from CPU scalars, the compiled call on the "eager" backend."""
    from speechattn.attention import flex

    hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    create_fw_bw_graph = hop.create_fw_bw_graph

    def on_cpu(score_mod, index_values, other_buffers):  # noqa: ANN001, ANN202
        def cpu(t):  # noqa: ANN001, ANN202
            if not isinstance(t, Tensor):
                return t
            return torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="cpu", requires_grad=t.requires_grad
            )

        with detect_fake_mode(index_values):
            index_values = tuple(cpu(t) for t in index_values)
            other_buffers = tuple(cpu(t) for t in other_buffers)
        return create_fw_bw_graph(score_mod, index_values, other_buffers)

    monkeypatch.setattr(hop, "create_fw_bw_graph", on_cpu)
    monkeypatch.setattr(flex, "CUDA_BACKEND", "eager")


def to_fake_cuda(module: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Move a real module's parameters and buffers to fake CUDA tensors (in place)."""
    with mode:
        return module.to(CUDA)


def backward(outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> dict[Tensor, Tensor]:
    """Gradients of `outputs` (seeded with `grads`) for every leaf that requires them, by
    calling each autograd node directly in dependency order (no autograd engine).

    Returns {leaf tensor: its gradient}; leaves the graph never reaches are absent.
    """
    roots = [(o.grad_fn, g) for o, g in zip(outputs, grads) if o.grad_fn is not None]
    pending: dict[object, int] = defaultdict(int)  # node -> inputs still to arrive
    seen, stack = set(), [n for n, _ in roots]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                pending[child] += 1
                stack.append(child)
    inbox: dict[object, dict[int, Tensor]] = defaultdict(dict)
    for node, g in roots:
        inbox[node][0] = inbox[node][0] + g if 0 in inbox[node] else g
    ready = [n for n in {n for n, _ in roots} if pending[n] == 0]
    leaves: dict[Tensor, Tensor] = {}
    while ready:
        node = ready.pop()
        received = inbox.pop(node, {})
        if type(node).__name__ == "AccumulateGrad":
            if 0 in received:
                leaves[node.variable] = received[0]
            continue
        count = len(node._input_metadata)
        # custom autograd Functions' nodes are not callable: their `apply` runs `backward`
        call = node if callable(node) else node.apply
        results = call(*[received.get(i) for i in range(count)])
        results = results if isinstance(results, tuple) else (results,)
        for (child, slot), g in zip(node.next_functions, results):
            if child is None:
                continue
            if g is not None:
                g = _as_input(g, child._input_metadata[slot])
                have = inbox[child].get(slot)
                inbox[child][slot] = g if have is None else have + g
            pending[child] -= 1
            if pending[child] == 0:
                ready.append(child)
    return leaves


def _as_input(grad: Tensor, metadata) -> Tensor:
    """What the engine's `validate_outputs` does to a node's gradient: sum it over the
    dimensions its input was broadcast along, and cast it to the input's dtype."""
    shape = tuple(metadata.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    if grad.dtype != metadata.dtype:
        grad = grad.to(metadata.dtype)
    if grad.device != metadata.device:
        raise RuntimeError(f"gradient on {grad.device} for an input on {metadata.device}")
    return grad


def parameter_grads(module: nn.Module, leaves: dict[Tensor, Tensor]) -> dict[str, Tensor]:
    """{parameter name: gradient} of `module` from `backward`'s result."""
    return {n: leaves[p] for n, p in module.named_parameters() if p in leaves}
