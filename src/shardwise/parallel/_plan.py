"""Step 1, plan: record every primitive call of a network and lay all plans on one matrix.

- `trace_calls`: runs the network once on meta tensors of the global shapes (parameters and
  buffers swapped for meta tensors with `torch.func.functional_call`, so nothing is computed or
  allocated) and records each `Primitive` call: the module, its global input shapes, its call
  arguments and which inputs are parameters (by name).
- `plan_network`: plans every call with `plan_primitive` (device_num = world size), finds the
  coarsest common refinement of all their device matrices (`common_refinement`) and moves every
  input / output layout onto that one global matrix (`refine`). It also fixes the layout each
  parameter is stored in (its ``parameter_plan`` entry, else the layout of its first consumer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.layout import DeviceMatrix, TensorLayout, common_refinement, refine
from shardwise.ops import OpPlan, Primitive, name_primitives, plan_primitive
from shardwise.parallel._errors import UnsupportedParallelError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PrimitiveCall:
    """One recorded primitive call.

    Attributes:
        module: the primitive module.
        input_shapes: global shapes of its tensor inputs.
        call_args: its non-tensor call arguments (Reshape's shape ...).
        params: input index -> name of the parameter passed there.
    """

    module: Primitive
    input_shapes: tuple[Shape, ...]
    call_args: Mapping[str, Any]
    params: Mapping[int, str]


@dataclass(frozen=True)
class CallPlan:
    """A recorded call with its `OpPlan` and the plan's layouts on the global matrix."""

    call: PrimitiveCall
    plan: OpPlan
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]


@dataclass(frozen=True)
class NetworkPlan:
    """Every primitive call of one forward, on one global device matrix.

    Attributes:
        matrix: the global matrix (axes ``g0, g1, ...``, the common refinement).
        calls: the calls in execution order.
        params: parameter name -> (layout on `matrix`, global shape).
    """

    matrix: DeviceMatrix
    calls: tuple[CallPlan, ...]
    params: Mapping[str, tuple[TensorLayout, Shape]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"NetworkPlan on {self.matrix}:"]
        lines += [f"  {c.plan}" for c in self.calls]
        lines += [f"  param {n}: {lay} {list(s)}" for n, (lay, s) in self.params.items()]
        return "\n".join(lines)


def trace_calls(
    network: nn.Module,
    input_shapes: Sequence[Shape],
    input_dtypes: Sequence[torch.dtype] | None = None,
) -> list[PrimitiveCall]:
    """Run `network` on meta tensors of `input_shapes` (and `input_dtypes`, default float32),
    recording each primitive call."""
    name_primitives(network)
    metas = {
        n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in network.named_parameters()
    }
    by_id = {id(t): n for n, t in metas.items()}
    metas |= {  # buffers (constants) on meta too: they meet meta activations
        n: torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in network.named_buffers()
    }
    calls: list[PrimitiveCall] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert isinstance(module, Primitive)
        tensors, call_args = module.split_call(*args)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise UnsupportedParallelError(f"{module.who}: non-tensor inputs are not supported yet")
        params = {i: by_id[id(t)] for i, t in enumerate(tensors) if id(t) in by_id}
        shapes = tuple(tuple(int(s) for s in t.shape) for t in tensors)
        calls.append(PrimitiveCall(module, shapes, {**call_args, **kwargs}, params))

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in network.modules()
        if isinstance(m, Primitive)
    ]
    try:
        dtypes = list(input_dtypes or [torch.float32] * len(input_shapes))
        inputs = tuple(
            torch.empty(s, dtype=d, device="meta")
            for s, d in zip(input_shapes, dtypes, strict=True)
        )
        torch.func.functional_call(network, metas, inputs)
    finally:
        for h in handles:
            h.remove()
    return calls


def plan_network(
    calls: Sequence[PrimitiveCall],
    device_num: int,
    extra_matrices: Sequence[Shape] = (),
    param_layouts: Mapping[str, tuple[TensorLayout, Shape]] | None = None,
) -> NetworkPlan:
    """Plan every call and bring all layouts onto the common refinement of their matrices.

    Args:
        calls: the traced primitive calls.
        device_num: the job's size.
        extra_matrices: more device-matrix shapes the global one must refine (the inputs'
            layouts under a per-input dataset strategy, `sw.reshard` layouts).
        param_layouts: parameter name -> (layout, global shape) in which it is stored
            (``parameter_plan``); the others are stored as their first consumer wants them. A
            consumer wanting another layout gets the parameter redistributed at each use.

    Raises:
        ValueError: the matrices have no common refinement.
    """
    plans = [
        plan_primitive(c.module, *c.input_shapes, device_num=device_num, **c.call_args)
        for c in calls
    ]
    given = dict(param_layouts or {})
    shapes = [p.matrix.shape for p in plans] + list(extra_matrices)
    shapes += [lay.matrix.shape for lay, _ in given.values()]
    shape = common_refinement(shapes or [(device_num,)])
    matrix = DeviceMatrix(shape, tuple(f"g{i}" for i in range(len(shape))))
    out: list[CallPlan] = []
    params = {name: (refine(lay, matrix), s) for name, (lay, s) in given.items()}
    for call, plan in zip(calls, plans, strict=True):
        ins = tuple(refine(t, matrix) for t in plan.inputs)
        outs = tuple(refine(t, matrix) for t in plan.outputs)
        out.append(CallPlan(call, plan, ins, outs))
        for i, name in call.params.items():
            params.setdefault(name, (ins[i], call.input_shapes[i]))
    return NetworkPlan(matrix, tuple(out), params)
