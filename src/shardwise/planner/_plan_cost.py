"""What a `ParallelPlan` costs under the automatic planners' model (`_cost.CostModel`).

`plan_cost(plan, model)` prices one forward of any plan (semi_auto, propagated, searched, a
hand-written Megatron one) the way `_search` prices candidates: the edges' redistributions and
the ops' own collectives and each parameter's gradient AllReduce over the axes that replicate
it (communication), each op's FLOPs over the devices that share it
(compute), and the bytes a rank holds (outputs kept for backward; each parameter's block with
its gradient and two optimizer moments) at ``memory_s_per_byte`` (memory). Backward is not
priced separately (it mirrors the forward's communication).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Replicate

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import TensorLayout
from shardwise.planner._cost import CostModel, load_cost_model
from shardwise.planner._flops import node_flops
from shardwise.planner._placement import _itemsize, placements_of
from shardwise.planner._plan import Collective, NodePlan, ParallelPlan

PARAM_COPIES = 4
"""A parameter's bytes a rank holds per stored element: itself, its gradient, two moments."""


def grad_sync(model: CostModel, layout: TensorLayout, block: int) -> float:
    """Seconds of a parameter's share of the gradient AllReduce (a `block`-byte block stored as
    `layout`) over the matrix axes that replicate it: its bytes only, since the gradients of
    many parameters travel in one fused bucket (the latency is paid once per bucket)."""
    m = layout.matrix
    used = set(layout.used_axes())
    axes = [a for a, size in enumerate(m.shape) if size > 1 and a not in used]
    if not axes:
        return 0.0
    group = math.prod(m.shape[a] for a in axes)
    worst = max(model._of(model.beta, a) for a in axes)
    return bytes_bound("AllReduce", block, group) * worst


@dataclass(frozen=True)
class PlanCost:
    """Seconds per forward by kind, and their sum (`total`)."""

    comm: float
    compute: float
    memory: float

    @property
    def total(self) -> float:
        return self.comm + self.compute + self.memory

    def __str__(self) -> str:
        return (
            f"{self.total * 1e6:.1f} us (comm {self.comm * 1e6:.1f}, compute "
            f"{self.compute * 1e6:.1f}, memory {self.memory * 1e6:.1f})"
        )


def _split(n: NodePlan) -> int:
    m = n.inputs[0].layout.matrix if n.inputs else n.outputs[0].layout.matrix
    used = 1
    for axis, size in enumerate(m.shape):
        if any(not isinstance(placements_of(p)[axis], Replicate) for p in (*n.inputs, *n.outputs)):
            used *= size
    return used


def _own(n: NodePlan, c: Collective, model: CostModel) -> float:
    m = n.outputs[c.output].layout.matrix
    block = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
    return model.combine(c.kind, block, m, [m.names.index(a) for a in c.axes])


def plan_cost(plan: ParallelPlan, model: CostModel | None = None) -> PlanCost:
    """The plan's cost (see the module docstring).

    Example:
        >>> print(plan_cost(plan))  # doctest: +SKIP
        412.5 us (comm 120.0, compute 280.0, memory 12.5)
    """
    model = model or load_cost_model()
    comm = 0.0
    for e in plan.edges:
        if e.shared or e.consumer == -1:
            continue
        reduced = e.reduced
        comm += model.move(e.src.layout, e.dst.layout, e.shape, _itemsize(e.dtype), reduced)
    compute = held = 0.0
    for n in plan.nodes:
        comm += sum(_own(n, c, model) for c in n.comms)
        flops = node_flops(n.op, n.in_shapes, n.shapes)
        compute += flops / _split(n) / model.flops_per_s if n.inputs or n.outputs else 0.0
        held += sum(math.prod(s) * _itemsize(n.dtype(k)) for k, s in enumerate(n.local_shapes))
    for p in plan.params.values():
        block = math.prod(p.layout.local_shape(p.shape)) * _itemsize(p.dtype)
        held += block * PARAM_COPIES
        comm += grad_sync(model, p.layout, block) if p.dtype.startswith("float") else 0.0
    return PlanCost(comm, compute, held * model.memory_s_per_byte)
