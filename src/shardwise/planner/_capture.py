"""Capture: run a network or a train step once on fake tensors and record every op.

`capture(fn, *args, **kwargs)` makes a `Graph`:

1. the tensor inputs become fake tensors of their global shapes (`_fake_like`, on `_device`),
   each named by `input_key` (``args[0]``, ``labels``);
2. every parameter and buffer of the networks is swapped for a fake tensor of the same global
   shape (`_torch.module_state.reparametrize`; a tied parameter is recorded once, `Graph.tied`;
   one that requires no gradient is listed in `Graph.frozen`); a training BatchNorm with
   ``momentum=None`` is given the factor its call computes from ``num_batches_tracked``
   (`_batch_norm.cumulative_momenta`, read from the real buffer first);
3. `fn` is called under the recorders of `_recorders`: `_Recorder`, a ``TorchFunctionMode``
   that makes one `Node` per torch-level call (``F.linear``, ``x.view(...)``,
   ``torch.arange``, ...), with `_aten_recorder.AtenRecorder` (a dispatch mode under it)
   listing the aten ops each call ran, and `_module_hooks.module_hooks` giving each node its
   module path. A shardwise primitive becomes one node (its inner calls are not recorded);
4. the returned tensors (and the train step's loss) become the graph's outputs; the nodes a
   custom ``torch.autograd.Function``'s forward ran are marked with its name
   (`_functions.function_of`); a buffer the call re-assigned to an op's output
   (``self.rm = 0.9 * self.rm + ...``) is noted with that output (`Graph.set_buffers`).

Nothing is computed and no process group is used. TorchScript that runs during the capture (a
``torch.jit.script`` / ``trace`` module or a scripted function) is refused at its first aten op,
which no torch-level call runs (`_aten_recorder`: the plan would lack its ops); the message
names the module or function (`_scripted.scripted_refusal`).

For a train step, capture ends at the first ``loss.backward()``: the step is not run further
(no backward, no optimizer step, no code of the user's after it on fake tensors), and the loss
is the graph's output. A step that runs the network again (gradient accumulation, an
optimizer's closure) runs the same plan again (`parallel._executor`). Reading a value in the
graph (``.item()``, ``bool(t)``) or an op whose output shape depends on values raises
`CaptureError` naming the op and the source line.

`CaptureError`, `FakeKernelError`, `dtype_name` and `info_of` (`_recorders`) and `record_kind`
(`_call_kinds`) are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise._torch.fake import FakeTensorMode, empty_fake, quiet_meta_failures
from shardwise._torch.module_state import reparametrize
from shardwise.ops import name_primitives
from shardwise.parameter._deferred import tracing
from shardwise.planner._aten_recorder import AtenRecorder
from shardwise.planner._batch_norm import cumulative_momenta
from shardwise.planner._call_kinds import record_kind
from shardwise.planner._gc import gc_paused
from shardwise.planner._graph import Graph, Ref, TensorInfo
from shardwise.planner._module_hooks import module_hooks
from shardwise.planner._recorders import (
    CaptureError,
    FakeKernelError,
    T,
    _Recorder,
    _State,
    _StopCapture,
    dtype_name,
    info_of,
    tensors_in,
)
from shardwise.planner._user_state import kept_real


def _fake_like(
    mode: FakeTensorMode, t: T, device: torch.device, shape: Sequence[int] | None = None
) -> T:
    """A fake tensor with `t`'s shape (or `shape`, contiguous), dtype and requires_grad, on
    `device`."""
    if shape is not None:
        size = tuple(shape)
        out = empty_fake(mode, size, _contiguous_strides(size), t.dtype, device)
    else:
        out = empty_fake(mode, tuple(t.shape), tuple(t.stride()), t.dtype, device)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _device(tensors: Sequence[T]) -> torch.device:
    for t in tensors:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


@gc_paused
def capture(
    fn: nn.Module | Callable[..., Any],
    *args: Any,
    networks: Sequence[nn.Module] | None = None,
    device: torch.device | str | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
    **kwargs: Any,
) -> Graph:
    """Record every op of one call of `fn` on fake tensors of the inputs' global shapes.

    Args:
        fn: a network (its forward is captured) or a train-step function (captured up to
            ``loss.backward()``).
        *args, **kwargs: the call's inputs (tensors anywhere in them: real, meta or fake; only
            their shapes and dtypes are used), as the global batch.
        networks: the modules whose parameters the graph names (default: `fn` itself, or the
            modules a train step references).
        device: the device the fake tensors claim (default: the inputs' first non-meta device,
            else CPU).
        param_shapes: parameter name -> its global shape, for parameters already cut to this
            rank's block (default: their own shapes).

    Returns:
        The `Graph`.

    Raises:
        CaptureError: a value read or a data-dependent shape (naming the op and line);
            TorchScript run by the call (naming the module or function).

    Example:
        >>> g = capture(model, torch.zeros(8, 16, dtype=torch.long), targets=targets)
        >>> print(g.nodes[0])
        %0 transformer.wte/embedding = torch.nn.functional.embedding(...) -> float32[8, 16, 32]
    """
    from shardwise.parallel._discover import find_objects, find_referenced, hook_objects

    if networks is None:
        if isinstance(fn, nn.Module):
            networks = [fn]
        else:
            networks = [m for m in find_referenced(fn)[0] if any(True for _ in m.parameters())]
    watched = [m for net in networks for m in net.modules()]  # (`kept_real`)
    outside = _outside_modules(fn, networks)  # (a teacher: its buffers put back, `_kept`)
    watched += hook_objects([*watched, *(m for o in outside for m in o.modules())])
    watched += [] if isinstance(fn, nn.Module) else find_objects(fn)
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    if device is None:
        device = _device([leaf for _, leaf in flat if isinstance(leaf, T)])
    device = torch.device(device)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    known: dict[int, Ref] = {}
    inputs: dict[str, TensorInfo] = {}
    leaves = []
    for path, leaf in flat:
        if isinstance(leaf, T):
            fake = _fake_like(mode, leaf, device)  # (requires grad as the input does)
            key = input_key(pytree.keystr(path))
            known[id(fake)] = Ref("input", key)
            inputs[key] = info_of(leaf)
            leaf = fake
        leaves.append(leaf)
    call_args, call_kwargs = pytree.tree_unflatten(leaves, spec)
    params: dict[str, TensorInfo] = {}
    buffers: dict[str, TensorInfo] = {}
    tied: dict[str, str] = {}
    frozen: list[str] = []
    modules: dict[int, str] = {}
    fakes: dict[int, T] = {}
    for i, net in enumerate(networks):
        prefix = "" if len(networks) == 1 else f"{i}."
        name_primitives(net)
        modules |= {id(m): prefix + p for p, m in net.named_modules()}
        first: dict[int, str] = {}
        for name, p in net.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[prefix + name] = prefix + first[id(p)]
                continue
            first[id(p)] = name
            shape = (param_shapes or {}).get(prefix + name)
            fakes[id(p)] = _fake_like(mode, p, device, shape)
            known[id(fakes[id(p)])] = Ref("param", prefix + name)
            params[prefix + name] = info_of(fakes[id(p)])
            if not p.requires_grad:
                frozen.append(prefix + name)
        for name, b in net.named_buffers():
            fakes[id(b)] = _fake_like(mode, b, device)
            known[id(fakes[id(b)])] = Ref("buffer", prefix + name)
            buffers[prefix + name] = info_of(b)
    grads = {id(g): g for net in networks for p in net.parameters() if (g := p.grad) is not None}
    state = _State(known, modules, grads)  # (the real gradients: an optimizer's zero_grad)
    state.keep += list(fakes.values())
    with ExitStack() as stack:
        stack.enter_context(kept_real(watched))  # (first in, last out: after the fakes go)
        stack.enter_context(_kept(outside))
        stack.enter_context(cumulative_momenta([*networks, *outside]))  # (the real buffers)
        for net in networks:
            stack.enter_context(reparametrize(net, fakes))
        stack.enter_context(tracing())  # (a delayed-init network is not materialized)
        stack.enter_context(quiet_meta_failures())  # (a FakeKernelError names the op instead)
        stack.enter_context(mode)
        stack.enter_context(module_hooks(state))
        stack.enter_context(AtenRecorder(state))
        stack.enter_context(_Recorder(state))
        try:
            out = fn(*call_args, **call_kwargs)
        except _StopCapture:
            out = None
        except Exception:
            if state.refused is not None:  # (the TorchScript interpreter's RuntimeError)
                raise state.refused from None
            raise
        if state.refused is not None:  # (the user's code caught it)
            raise state.refused
        set_buffers = _set_buffers(networks, state.known)  # (before the buffers are put back)
    outs = tensors_in(out)
    returned = [state.known[id(t)] for t in outs if id(t) in state.known]
    returned += [r for r in state.backward_roots if r not in returned]
    marks = state.functions
    nodes = [replace(n, function=marks[n.index]) if n.index in marks else n for n in state.nodes]
    return Graph(
        nodes=tuple(nodes),
        inputs=inputs,
        params=params,
        buffers=buffers,
        consts=tuple(state.consts),
        outputs=tuple(returned),
        tied=tied,
        roots=tuple(state.backward_roots) if state.all_roots_known else (),
        regions=state.regions.regions(),
        frozen=tuple(frozen),
        set_buffers=set_buffers,
        size_reads=tuple(state.size_reads),
    )


def _outside_modules(fn: Callable[..., Any], networks: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules a train step uses besides `networks` (a knowledge-distillation teacher):
    their weights and buffers are constants of the graph."""
    if isinstance(fn, nn.Module):
        return []
    from shardwise.parallel._discover import find_referenced

    inside = {id(m) for net in networks for m in net.modules()}
    return [m for m in find_referenced(fn)[0] if id(m) not in inside]


@contextmanager
def _kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """The buffers of `modules` (real tensors, not made fake: constants) as they were before the
    capture ran their forward (a training BatchNorm's ``num_batches_tracked.add_(1)`` and
    running statistics), put back after it."""
    saved = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _set_buffers(networks: Sequence[nn.Module], known: Mapping[int, Ref]) -> dict[str, Ref]:
    """Each buffer of `networks` that holds an op's output after the call (re-assigned in
    ``forward``: ``self.rm = 0.9 * self.rm + 0.1 * x.mean(0)``) -> that output."""
    out: dict[str, Ref] = {}
    for i, net in enumerate(networks):
        prefix = "" if len(networks) == 1 else f"{i}."
        for name, b in net.named_buffers():
            ref = known.get(id(b))
            if ref is not None and ref.kind == "node":
                out[prefix + name] = ref
    return out


def input_key(path: str) -> str:
    """``"[0][1]"`` (args, position 1) -> ``"args[1]"``; ``"[1]['labels']"`` -> ``"labels"``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    rest = path[3:]
    if rest.startswith("['") and rest.endswith("']") and rest.count("[") == 1:
        return rest[2:-2]
    return "kwargs" + rest


__all__ = [
    "CaptureError",
    "FakeKernelError",
    "capture",
    "dtype_name",
    "info_of",
    "input_key",
    "record_kind",
]
