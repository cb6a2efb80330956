"""Where each primitive input comes from, and how the runtime will redistribute it.

A `NetworkPlan` holds every call's layouts but not the data flow between calls. The runtime
(`AutoParallel`) redistributes each non-parameter input from the layout its producer left (the
producer call's output layout, or the data-parallel layout for a network input) to the layout
its plan wants; parameters are already this rank's block. This module reproduces that without
running anything but a meta-tensor forward:

- `Source`: what feeds one input (network input, a call's output, a parameter, or unknown).
- `trace_sources`: runs the network once on meta tensors and records the `Source` of every
  input of every primitive call, in call order, and of every network output (`Dataflow`).
- `input_redistributions`: the `RedistributionPlan` of every input (None: no redistribution,
  i.e. a parameter or a constant), computed with `plan_redistribution`.

Results of unannotated torch ops are taken as data parallel, which is what the runtime makes
of them except for reductions to one value (losses, full sums), which it keeps whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.layout import TensorLayout
from shardwise.ops import Primitive
from shardwise.parallel._plan import NetworkPlan
from shardwise.parallel._runtime import data_parallel_layout, replicated_layout
from shardwise.redistribution import RedistributionPlan, plan_redistribution

SourceKind = Literal["input", "call", "param", "torch", "const"]
InputState = TensorLayout | Literal["dp", "rep"]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """What feeds one primitive input.

    Attributes:
        kind: ``"input"`` (network input `index`), ``"call"`` (output `output` of call
            `index`), ``"param"`` (parameter `name`), ``"torch"`` (an unannotated torch op on
            activations: data parallel at run time) or ``"const"`` (a tensor computed from no
            activation: whole on every rank).
        index: the network input's or the producing call's index.
        output: which output of the producing call.
        name: the parameter's name.
    """

    kind: SourceKind
    index: int = 0
    output: int = 0
    name: str = ""


@dataclass(frozen=True)
class Dataflow:
    """The sources of every primitive call's inputs (call order) and of the network outputs."""

    calls: tuple[tuple[Source, ...], ...]
    outputs: tuple[Source, ...]
    inputs: tuple[InputState, ...] = ()

    def input_state(self, index: int) -> InputState:
        """How network input `index` arrives: ``"dp"`` (default), ``"rep"`` or a layout."""
        return self.inputs[index] if index < len(self.inputs) else "dp"


def _tensors(out: Any) -> list[Any]:
    if isinstance(out, tuple | list | dict):
        values = out.values() if isinstance(out, dict) else out
        return [t for o in values for t in _tensors(o)]
    return [out] if isinstance(out, torch.Tensor) else []


class _Tracer(TorchFunctionMode):
    """Records the `Source` of every tensor seen during a meta forward.

    Torch functions applied to an activation (a network input, a primitive's output or a
    result of such functions) produce ``"torch"`` values; the hooks on the primitives record
    each call's input sources and name its outputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[int, tuple[torch.Tensor, Source]] = {}
        self.calls: list[tuple[Source, ...]] = []
        self.inside = 0

    def put(self, t: torch.Tensor, source: Source) -> None:
        self.known[id(t)] = (t, source)

    def lookup(self, t: Any) -> Source:
        found = self.known.get(id(t))
        return found[1] if found is not None and found[0] is t else Source("const")

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.inside:  # inside a primitive: its output is named by `after`
            return out
        seen = [self.lookup(t) for t in _tensors([args, kwargs or {}])]
        if any(s.kind in ("input", "call", "torch") for s in seen):
            for t in _tensors(out):
                if self.lookup(t).kind == "const":
                    self.put(t, Source("torch"))
        return out

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        assert isinstance(module, Primitive)
        tensors, _ = module.split_call(*args)
        self.calls.append(tuple(self.lookup(t) for t in tensors))
        self.inside += 1

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.inside -= 1
        outs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
        for k, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                self.put(t, Source("call", index=len(self.calls) - 1, output=k))


def trace_sources(
    network: nn.Module,
    input_shapes: Sequence[Shape],
    param_shapes: Mapping[str, Shape] | None = None,
    input_states: Sequence[InputState] | None = None,
    input_dtypes: Sequence[torch.dtype] | None = None,
) -> Dataflow:
    """The `Source` of every tensor input of every primitive call and of every output.

    Runs `network` once on meta tensors of `input_shapes` (parameters swapped for meta tensors,
    as `shardwise.parallel.trace_calls` does): nothing is computed or allocated.

    Args:
        network: the network.
        input_shapes: global shapes of its inputs.
        param_shapes: global shapes of parameters that are already cut to this rank's block
            (``{n: s for n, (_, s) in plan.params.items()}``); others keep their own shape.
        input_states: how each network input arrives: ``"dp"`` (this rank's rows: the
            default), ``"rep"`` (whole on every rank: ``full_batch``) or a layout on the plan's
            matrix.
        input_dtypes: the inputs' dtypes (default: float32; token ids need their int dtype).
    """
    given = dict(param_shapes or {})
    params = {
        n: torch.empty(given.get(n, tuple(p.shape)), dtype=p.dtype, device="meta")
        for n, p in network.named_parameters()
    }
    dtypes = list(input_dtypes or [torch.float32] * len(input_shapes))
    pairs = zip(input_shapes, dtypes, strict=True)
    inputs = tuple(torch.empty(s, dtype=d, device="meta") for s, d in pairs)
    tracer = _Tracer()
    for n, t in params.items():
        tracer.put(t, Source("param", name=n))
    for i, t in enumerate(inputs):
        tracer.put(t, Source("input", index=i))
    prims = [m for m in network.modules() if isinstance(m, Primitive)]
    handles = [m.register_forward_pre_hook(tracer.before) for m in prims]
    handles += [m.register_forward_hook(tracer.after) for m in prims]
    try:
        with tracer:
            buffers = {
                n: torch.empty(b.shape, dtype=b.dtype, device="meta")
                for n, b in network.named_buffers()
            }
            result = torch.func.functional_call(network, params | buffers, inputs)
    finally:
        for h in handles:
            h.remove()
    outputs = tuple(tracer.lookup(t) for t in _tensors(result))
    return Dataflow(tuple(tracer.calls), outputs, tuple(input_states or ()))


def check_flow(plan: NetworkPlan, flow: Dataflow) -> None:
    """Raise ValueError unless `flow` has one entry per call of `plan` and per input."""
    if len(flow.calls) != len(plan.calls):
        raise ValueError(
            f"report: {len(flow.calls)} traced primitive calls but the plan has {len(plan.calls)}"
        )
    for cp, srcs in zip(plan.calls, flow.calls, strict=True):
        if len(srcs) != len(cp.inputs):
            raise ValueError(
                f"report: {cp.plan.who}: traced {len(srcs)} inputs, planned {len(cp.inputs)}"
            )


def source_layout(
    plan: NetworkPlan, flow: Dataflow, source: Source, ndim: int
) -> TensorLayout | None:
    """The layout the runtime tracks for `source`, an `ndim`-d tensor: data parallel for a
    network input (unless `flow` says otherwise) and for the result of an unannotated torch op,
    the plan's output layout for a call's output; None for a parameter (already this rank's
    block) and a constant (refused by the runtime)."""
    if source.kind == "input":
        state = flow.input_state(source.index)
        if state == "rep":
            return replicated_layout(plan.matrix, ndim)
        return data_parallel_layout(plan.matrix, ndim) if state == "dp" else state
    if source.kind == "torch":
        return data_parallel_layout(plan.matrix, ndim)
    if source.kind == "call":
        return plan.calls[source.index].outputs[source.output]
    return None


def input_redistributions(
    plan: NetworkPlan, flow: Dataflow, itemsize: int = 4
) -> list[tuple[RedistributionPlan | None, ...]]:
    """The redistribution of every input of every call (None: none happens).

    Raises:
        ValueError: `flow` does not have one entry per call and per input of `plan`.
    """
    check_flow(plan, flow)
    out: list[tuple[RedistributionPlan | None, ...]] = []
    for cp, srcs in zip(plan.calls, flow.calls, strict=True):
        row: list[RedistributionPlan | None] = []
        for src, dst, shape in zip(srcs, cp.inputs, cp.call.input_shapes, strict=True):
            have = source_layout(plan, flow, src, len(shape))
            row.append(None if have is None else plan_redistribution(have, dst, shape, itemsize))
        out.append(tuple(row))
    return out


def output_redistributions(
    plan: NetworkPlan, outputs: Sequence[Source], itemsize: int = 4
) -> list[tuple[Source, RedistributionPlan | None]]:
    """How the wrapper brings each network output (a call output) back to data parallel."""
    out: list[tuple[Source, RedistributionPlan | None]] = []
    for src in outputs:
        if src.kind != "call":
            out.append((src, None))
            continue
        cp = plan.calls[src.index]
        have, shape = cp.outputs[src.output], cp.plan.output_shapes[src.output]
        want = data_parallel_layout(plan.matrix, len(shape))
        out.append((src, plan_redistribution(have, want, shape, itemsize)))
    return out
