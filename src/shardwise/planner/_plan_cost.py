"""What a `ParallelPlan` costs under the automatic planners' model (`_cost.CostModel`).

`plan_cost(plan, model)` prices one forward of any plan (semi_auto, propagated, searched, a
hand-written Megatron one) by the model `_search` prices candidates with: the edges'
redistributions as the plan runs them (a ReduceScatter where the plan fused one) and the ops'
own collectives and each parameter's gradient AllReduce over the axes that replicate it
(communication), each op's FLOPs over the devices that share it (compute), and the bytes a rank
holds (outputs kept for backward; each parameter's block with its gradient and Adam's two
moments) at ``memory_s_per_byte`` (memory). The search itself prices every sum reduction meeting
a cut as a ReduceScatter and the job's own optimizer state, so for a plan whose edges the
executor keeps whole, or an optimizer other than Adam, the two can differ slightly. Backward is
not priced separately (it mirrors the forward's communication).

`step_cost(plan, model)` estimates the seconds of one training step (forward, backward,
optimizer) on a rank of a plan that is a train step (`StepCost`):

- forward communication: every edge's move (the values a step returns too: the loss's
  AllReduce; an AllReduce and Slice run as one ReduceScatter, `EdgePlan.scatter`, as that:
  `edge_move`) and every op's own collective, each collective at ``call_s`` plus its rounds
  and bytes;
- backward communication: their adjoints (an AllReduce's is an AllReduce over the axes whose
  gradient is not already equal, an AllGather's a ReduceScatter, an AlltoAll's the reverse
  AlltoAll, a Slice's nothing; none for values no gradient flows back to
  (`ParallelPlan.gradient_values`: the step's inputs and what is computed from them only,
  integer values) and the returned values, the step's backward having run before they are
  moved; none for an op's own AllReduce that makes the loss backward starts from,
  `root_collectives`), and the ops' gradient AllReduces (`NodePlan.backward`);
- gradient synchronization: one AllReduce per gradient bucket (`ParallelPlan.buckets`; a plan
  without them: the parameters grouped by the axes that replicate their gradient, in buckets of
  at most 25 MB), optimizer parallel's ReduceScatter and AllGather (at level 3 a second
  AllGather in backward for a bucket with a weight autograd saves or a checkpointed region
  recomputes with, `_regathered`; an AllReduce over the copies when the shard group is smaller
  than the data-parallel one);
- activation checkpointing: each region's replay in backward (`_regions.Region`): its input
  moves and ops' collectives again, as far as torch's recomputation goes (backward
  communication), and its ops' forward FLOPs again (compute);
- compute: per op, ``op_s`` plus the larger of its forward and backward FLOPs (three times the
  forward's: backward computes the gradients of both operands of a product) at
  ``flops_per_s`` and the bytes it reads and writes at ``traffic_s_per_byte`` (which includes
  backward's traffic); a view costs ``op_s`` only;
- optimizer: per stored parameter ``optimizer_s_per_tensor`` plus its block's elements (a
  1/k slice under optimizer parallel) at ``optimizer_s_per_element``.

Collectives are priced one after another and never overlapped with compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch.distributed.tensor import Replicate

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import TensorLayout
from shardwise.nn.grad_reducer import DEFAULT_BUCKET_MB
from shardwise.planner._cost import CostModel, load_cost_model
from shardwise.planner._flops import is_view, node_elements, node_flops
from shardwise.planner._graph import Ref
from shardwise.planner._placement import _itemsize, placements_of
from shardwise.planner._plan import Collective, EdgePlan, NodePlan, ParallelPlan
from shardwise.planner._regathered import regathered_params
from shardwise.planner._regions import Region
from shardwise.planner._seeded import root_collectives

PARAM_COPIES = 4
"""A parameter's bytes a rank holds per stored element: itself, its gradient and Adam's two
moments (the search's default; under `AutoParallel` it counts the job's optimizer's state)."""
BACKWARD_FLOPS = 2
"""Backward's FLOPs per forward FLOP (a product's gradient with respect to both operands)."""


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
        comm += edge_move(e, model, e.reduced)
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


@dataclass(frozen=True)
class StepCost:
    """Seconds of one training step on a rank by part (see the module docstring), and the
    collectives it runs.

    Attributes:
        forward_comm / backward_comm: the edges' and ops' collectives, and their adjoints.
        grad_sync: the gradient buckets' collectives.
        compute: every op's forward and backward.
        optimizer: the parameters' update.
        collectives: how many collectives a step runs (as `CommRecorder` counts them).
    """

    forward_comm: float
    backward_comm: float
    grad_sync: float
    compute: float
    optimizer: float
    collectives: int

    @property
    def comm(self) -> float:
        return self.forward_comm + self.backward_comm + self.grad_sync

    @property
    def total(self) -> float:
        return self.comm + self.compute + self.optimizer

    def __str__(self) -> str:
        return (
            f"{self.total * 1e3:.2f} ms (comm {self.comm * 1e3:.2f}: forward "
            f"{self.forward_comm * 1e3:.2f}, backward {self.backward_comm * 1e3:.2f}, gradients "
            f"{self.grad_sync * 1e3:.2f}; compute {self.compute * 1e3:.2f}, optimizer "
            f"{self.optimizer * 1e3:.2f}; {self.collectives} collectives)"
        )


def _edge_collectives(e: EdgePlan, backward: bool) -> int:
    m = e.src.layout.matrix
    reduced = [a for a in e.reduced if not backward or _unequal(e, a)]
    count = 1 if any(m.shape[a] > 1 for a in reduced) else 0
    return count + len(e.collectives("")) - (1 if e.reduced else 0)


def _unequal(e: EdgePlan, axis: int) -> bool:
    """Whether the adjoint of edge `e`'s AllReduce over `axis` is a collective: not when the
    gradient is equal there (`equal_grad`) or in ``loss.backward()`` (`seeded`)."""
    return not e.seeded and axis not in e.equal_grad


def _has_gradient(e: EdgePlan, needs: set[str]) -> bool:
    """Whether backward runs the edge's adjoint: a value whose gradient backward computes
    (`needs`: `ParallelPlan.gradient_values`; not one computed from the inputs only) consumed
    by an op (not returned)."""
    return e.consumer != -1 and e.value in needs


def _edge_backward(e: EdgePlan, model: CostModel) -> float:
    """The adjoint of an edge's move: its AllReduce over the axes whose gradient is not equal
    (none when `seeded`), and per AllGather / AlltoAll step a ReduceScatter / AlltoAll sending
    the same bytes."""
    reduced = tuple(a for a in e.reduced if _unequal(e, a))
    return edge_move(e, model, reduced)


def edge_move(e: EdgePlan, model: CostModel, reduced: tuple[int, ...]) -> float:
    """Seconds of edge `e`'s move with its partial sums over `reduced` summed: the AllReduce
    and the steps, or, for a `EdgePlan.scatter` edge, the ReduceScatter over its `cuts`' axes
    (its adjoint, an AllGather, costs as much), the AllReduce over the other axes on the part,
    and the steps after the cuts."""
    size = _itemsize(e.dtype)
    axes = e.scatter_axes
    if not axes:
        return model.move(e.src.layout, e.dst.layout, e.shape, size, reduced, scatter=False)
    block = math.prod(e.src.layout.local_shape(e.shape)) * size
    k = math.prod(e.src.layout.matrix.shape[a] for a in axes)
    scatter = model.collective("ReduceScatter", block, k, axes[0])
    # (from the cut layout: its AllReduce over the other axes on the part, then the steps)
    return scatter + model.move(e.after_scatter, e.dst.layout, e.shape, size, e.summed, False)


def _own_backward(n: NodePlan, c: Collective, model: CostModel) -> tuple[float, int]:
    m = n.outputs[c.output].layout.matrix
    block = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
    if c.kind == "ReduceScatter":  # its adjoint, an AllGather of the output block, as much
        return _own(n, c, model), 1
    axes = [m.names.index(a) for a in c.axes if a not in c.equal_grad]
    if math.prod(m.shape[a] for a in axes) <= 1:
        return 0.0, 0
    return model.all_reduce(block, m, axes), 1


def _f(n: NodePlan, c: Collective, model: CostModel) -> tuple[float, int]:
    """An AllReduce(avg) of an output's gradient (`NodePlan.backward`)."""
    m = n.outputs[c.output].layout.matrix
    axes = [m.names.index(a) for a in c.axes]
    if math.prod(m.shape[a] for a in axes) <= 1:
        return 0.0, 0
    block = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
    return model.all_reduce(block, m, axes), 1


def _block_bytes(plan: ParallelPlan, name: str) -> int:
    p = plan.params[name]
    return math.prod(p.layout.local_shape(p.shape)) * _itemsize(p.dtype)


def _sync_axes(plan: ParallelPlan, name: str) -> tuple[int, ...]:
    """The axes a parameter's gradient is all-reduced over: those replicating it, less those
    on which the plan makes it equal."""
    p = plan.params[name]
    used, equal = set(p.layout.used_axes()), set(plan.equal_grads.get(name, ()))
    m = p.layout.matrix
    return tuple(a for a, k in enumerate(m.shape) if k > 1 and a not in used and a not in equal)


def _grad_sync(plan: ParallelPlan, model: CostModel) -> tuple[float, int, dict[str, int]]:
    """(seconds, collectives, parameter -> optimizer-parallel shard count) of the gradient
    buckets."""
    m, secs, count, sharded = plan.matrix, 0.0, 0, {}
    if plan.buckets:
        again = regathered_params(plan)  # (level 3: gathered again in backward)
        for b in plan.buckets:
            axes = [m.names.index(a) for a in b.axes]
            group = math.prod(m.shape[a] for a in axes)
            nbytes = sum(_block_bytes(plan, name) for name in b.params if name in plan.params)
            if group <= 1 or nbytes == 0:
                continue
            if b.kind == "shard":
                sharded.update({name: b.shard for name in b.params})
                gathers = 2 if b.level == "level3" and again.intersection(b.params) else 1
                secs += model.collective("ReduceScatter", nbytes, b.shard, axes[0])
                secs += gathers * model.collective("AllGather", nbytes // b.shard, b.shard, axes[0])
                count += 1 + gathers
                if group > b.shard:  # (the AllReduce over the shards' copies)
                    secs += model.all_reduce(nbytes // b.shard, m, axes)
                    count += 1
            else:
                secs += model.all_reduce(nbytes, m, axes)
                count += 1
        return secs, count, sharded
    groups: dict[tuple[int, ...], int] = {}
    for name, p in plan.params.items():
        over = _sync_axes(plan, name)
        if over and p.dtype.startswith("float"):
            groups[over] = groups.get(over, 0) + _block_bytes(plan, name)
    cap = int(DEFAULT_BUCKET_MB * (1 << 20))
    for over, nbytes in groups.items():
        buckets = -(-nbytes // cap)
        secs += buckets * model.all_reduce(-(-nbytes // buckets), m, over)
        count += buckets
    return secs, count, sharded


def _compute(n: NodePlan, model: CostModel, backward: bool = True) -> float:
    """Seconds of node `n`'s forward and (`backward`) backward."""
    if is_view(n.op):
        return model.op_s
    ins = [p.local_shape(s) for p, s in zip(n.inputs, n.in_shapes, strict=False)]
    elements = node_elements(n.op, ins, n.local_shapes)
    flops = node_flops(n.op, n.in_shapes, n.shapes) / _split(n)
    itemsize = _itemsize(n.dtype(0)) if n.outputs else 4
    work = max(
        (1 + (BACKWARD_FLOPS if backward else 0)) * flops / model.flops_per_s,
        elements * itemsize * model.traffic_s_per_byte,
    )
    return model.op_s + work


def replayed_moves(plan: ParallelPlan, region: Region) -> list[tuple[NodePlan, EdgePlan]]:
    """The input moves a checkpointed region's replay runs in backward, in order, each with the
    node it feeds: its nodes' in-edges as far as torch's recomputation goes (`Region`); a move
    shared with an earlier consumer runs again (``shared`` off) unless that consumer was
    replayed too (the replay's executor starts with no moved values).

    Example:
        >>> [(n.name, e.slot) for n, e in replayed_moves(plan, plan.regions[0])]  # doctest: +SKIP
        [('fc1/linear', 0)]
    """
    by_consumer = plan.edges_by_consumer()
    out, moved = [], set[tuple[str, object]]()
    for k in region.replayed():
        for e in by_consumer.get(k, []):
            if e.shared and (e.value, e.dst) in moved:
                continue
            moved.add((e.value, e.dst))
            out.append((plan.nodes[k], replace(e, shared=False)))
    return out


def _recompute(plan: ParallelPlan, region: Region, model: CostModel) -> tuple[float, int, float]:
    """A checkpointed region's replay in backward: (seconds of its collectives, how many, its
    forward compute): its input moves (`replayed_moves`) and its ops' own collectives, as far
    as torch's recomputation goes (`_regions.Region`)."""
    secs = compute = 0.0
    calls = 0
    for _, e in replayed_moves(plan, region):
        secs += edge_move(e, model, e.reduced)
        calls += _edge_collectives(e, backward=False)
    for k in region.replayed():
        n = plan.nodes[k]
        if region.runs_own(k):
            secs += sum(_own(n, c, model) for c in n.comms)
            calls += len(n.comms)
        compute += _compute(n, model, backward=False) if n.inputs or n.outputs else 0.0
    return secs, calls, compute


def step_cost(plan: ParallelPlan, model: CostModel | None = None) -> StepCost:
    """The seconds of one training step on a rank of `plan` (see the module docstring).

    Example:
        >>> print(step_cost(plan))  # doctest: +SKIP
        18.40 ms (comm 2.10: forward 0.40, backward 0.00, gradients 1.70; compute 12.10,
        optimizer 4.20; 2 collectives)
    """
    model = model or load_cost_model()
    forward = backward = 0.0
    count = 0
    needs = plan.gradient_values()
    for e in plan.edges:
        if e.shared:
            continue
        forward += edge_move(e, model, e.reduced)
        count += _edge_collectives(e, backward=False)
        if _has_gradient(e, needs):
            backward += _edge_backward(e, model)
            count += _edge_collectives(e, backward=True)
    compute = 0.0
    at_root = root_collectives(plan)  # (local in loss.backward(): no adjoint)
    for n in plan.nodes:
        for i, c in enumerate(n.comms):
            forward += _own(n, c, model)
            count += 1
            if str(Ref("node", n.index, c.output)) in needs and (n.index, i) not in at_root:
                secs, calls = _own_backward(n, c, model)
                backward, count = backward + secs, count + calls
        for c in n.backward:
            secs, calls = _f(n, c, model)
            backward += secs
            count += calls
        compute += _compute(n, model) if n.inputs or n.outputs else 0.0
    for region in plan.regions:  # (recomputed in backward: the region's forward again)
        secs, again, work = _recompute(plan, region, model)
        backward, count, compute = backward + secs, count + again, compute + work
    synced, calls, sharded = _grad_sync(plan, model)
    optimizer = 0.0
    for name, p in plan.params.items():
        if not p.dtype.startswith("float"):
            continue
        elements = math.prod(p.layout.local_shape(p.shape)) / sharded.get(name, 1)
        optimizer += model.optimizer_s_per_tensor + elements * model.optimizer_s_per_element
    return StepCost(forward, backward, synced, compute, optimizer, count + calls)
