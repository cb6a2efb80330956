"""What one rank of a planned job holds and sends per step: the dry run's ``summary.txt``.

Everything here is computed from the `ParallelPlan` (and the optimizer-parallel plan), with no
process group and no tensor data:

- `find_optimizer`: the optimizer over a network's parameters.
- `optimizer_state_per_element`: elements of state a torch optimizer keeps per parameter
  element (Adam / AdamW 2, 3 with ``amsgrad``; SGD 1 with momentum, else 0; ...).
- `memory_tensors`: every tensor one rank holds, with its kind: parameters, gradients,
  optimizer state (each by its hsdp level), activations kept for backward, communication
  buffers; ``sw.runtime.set_memory``'s check (`runtime.check_memory`) and `estimate_memory`
  both read it (one model).
- `estimate_memory`: a `MemoryEstimate` of one rank: those kinds summed, and the peak (their
  sum: everything is held at once at the end of backward, before the step).
- `step_traffic`: the collectives of one training step with the bytes this rank sends in each:
  the forward's (as ``execute.ir`` lists them), the backward's (each forward step's adjoint:
  AllGather -> ReduceScatter, AlltoAll -> AlltoAll, an AllReduce -> an AllReduce over the
  axes on which the plan does not make its gradient equal, a local slice -> nothing; the
  plan's gradient averages), and the gradient synchronisation of the plan's gradient or
  optimizer-parallel buckets; `Traffic` sums them by collective kind and mesh axis. A train
  step's ``loss.backward()`` starts at the loss: the AllReduce that made it whole (a returned
  value's, or the op's own that makes it, `planner.root_collectives`) has no adjoint there.
- `format_summary`: the text of ``summary.txt`` (with the cost model's estimate of the step
  time, `planner.step_cost`, and of one forward, `planner.plan_cost`).

The memory model per parameter of op-level block ``B`` bytes sharded ``s`` ways by optimizer
parallel (``s = 1`` when not): level 1 keeps the whole compute leaf ``B`` and its shard
``B / s``, whole gradients ``B`` (reduce-scattered at the step into ``B / s``) and state on the
shard; level 2 keeps the leaf and the shard, gradients only as shards; level 3 keeps only the
shard (the leaf is gathered for forward and again for backward: a communication buffer).
Activations: every op's local outputs, all kept (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix
from shardwise.optim import OptimizerPlan
from shardwise.planner import (
    Collective,
    EdgePlan,
    ParallelPlan,
    Region,
    plan_cost,
    regathered_params,
    replayed_moves,
    root_collectives,
    step_cost,
)
from shardwise.redistribution import AllGather, AlltoAll
from shardwise.report._memory import (
    KINDS,
    MemoryEstimate,
    estimate_memory,
    find_optimizer,
    memory_tensors,
    optimizer_state_per_element,
)
from shardwise.report._sends import Found, LocalSlice, edge_sends, node_sends
from shardwise.runtime import format_size

__all__ = [
    "KINDS",
    "MemoryEstimate",
    "Traffic",
    "estimate_memory",
    "find_optimizer",
    "format_summary",
    "memory_tensors",
    "op_traffic",
    "optimizer_state_per_element",
    "step_traffic",
]


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _param_blocks(plan: ParallelPlan) -> dict[str, int]:
    """Parameter -> bytes of this rank's op-level block."""
    return {
        name: math.prod(p.layout.local_shape(p.shape)) * _itemsize(p.dtype)
        for name, p in plan.params.items()
    }


@dataclass
class Traffic:
    """Bytes this rank sends per step and collective counts, by (phase, kind, mesh axes)."""

    sent: dict[tuple[str, str, str], int] = field(default_factory=dict)
    count: dict[tuple[str, str, str], int] = field(default_factory=dict)
    rows: list[tuple[str, Collective, int]] = field(default_factory=list)  # (in plan order)
    # (indices of backward rows a train step's loss.backward() does not run: the adjoints of
    # returned values' moves and of `planner.root_collectives`; `op_traffic` without in_step)
    none_in_step: set[int] = field(default_factory=set)

    def add(self, phase: str, c: Collective, nbytes: int) -> None:
        key = (phase, c.kind, ",".join(c.axes))
        self.sent[key] = self.sent.get(key, 0) + nbytes
        self.count[key] = self.count.get(key, 0) + 1
        self.rows.append((phase, c, nbytes))

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def step_traffic(plan: ParallelPlan, rank: int, optimizer: OptimizerPlan | None) -> Traffic:
    """The collectives of one training step on `rank` (see the module docstring).

    Args:
        plan: the plan (its `ParallelPlan.buckets`: the gradient or optimizer-parallel
            buckets).
        rank: the rank whose bytes are counted.
        optimizer: the optimizer-parallel plan (its hsdp level: level 3 gathers the weights
            again in backward); None: level 1.

    Returns:
        The `Traffic`.

    Example:
        >>> step_traffic(plan, 0, None).total  # doctest: +SKIP
        6144
    """
    out = op_traffic(plan, rank, in_step=True)
    level = optimizer.config.optimizer_level if optimizer is not None else "level1"
    _gradient_sync(out, plan, level, regathered_params(plan))
    return out


def op_traffic(plan: ParallelPlan, rank: int, in_step: bool = False) -> Traffic:
    """The collectives the plan's ops and edges run on `rank` in one step, in the order the
    forward runs them: the forward's and their adjoints in backward (with the plan's gradient
    averages), without the buckets'. Backward runs the adjoints in the reverse order.
    `in_step`: the train step's ``loss.backward()`` starts backward at its roots, so the
    AllReduce that makes a returned loss whole (on its return edge, or the own collective of
    the op that makes it: `planner.root_collectives`) has no adjoint; without it, those
    adjoints are counted and their rows are in `Traffic.none_in_step` (`execute.ir` lists them,
    marked none).

    Example:
        >>> [str(c) for phase, c, _ in op_traffic(plan, 0).rows if phase == "backward"]
        ['ReduceScatter over g1 at fc2/linear input 0', ...]
    """
    out = Traffic()
    m = plan.matrix
    needs = plan.gradient_values()
    by_consumer = plan.edges_by_consumer()
    for e in by_consumer.get(-2, []):
        _edge_traffic(out, e, "entry", m, rank, needs)
    at_root = root_collectives(plan)
    for n in plan.nodes:
        for e in by_consumer.get(n.index, []):
            _edge_traffic(out, e, f"{n.name} input {e.slot}", m, rank, needs)
        for i, (c, _, sent) in enumerate(_collectives(node_sends(n, m, rank))):
            out.add("forward", c, sent)
            if _value(n.index, c.output) not in needs or (in_step and (n.index, i) in at_root):
                continue
            axes = tuple(m.names.index(a) for a in c.axes)
            if c.kind == "AllReduce":
                equal = tuple(m.names.index(a) for a in c.equal_grad)
                block = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
                first = len(out.rows)
                _adjoint(out, m, rank, c, axes, equal, block)
                if (n.index, i) in at_root:
                    out.none_in_step.update(range(first, len(out.rows)))
            elif c.kind in ("ReduceScatter", "AllGather"):  # (a batch norm's statistics)
                back = "AllGather" if c.kind == "ReduceScatter" else "ReduceScatter"
                out.add("backward", Collective(back, c.axes, c.where), sent)
        for c in n.backward:
            size = len(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
            nbytes = math.prod(n.local_shapes[c.output]) * _itemsize(n.dtype(c.output))
            out.add("backward", c, bytes_bound(c.kind, nbytes, size))
    roots = {r.value for r in plan.roots} if in_step else set()
    for e in by_consumer.get(-1, []):
        first = len(out.rows)
        _edge_traffic(out, e, f"return {e.slot}", m, rank, needs - roots)
        out.none_in_step.update(range(first, len(out.rows)))  # (its forward rows: never read)
    for region in plan.regions:
        _recompute_traffic(out, plan, region, rank)
    return out


def _recompute_traffic(out: Traffic, plan: ParallelPlan, region: Region, rank: int) -> None:
    """A checkpointed region's replay in backward (phase ``recompute``): the collectives of
    its input moves (`planner.replayed_moves`) and of its ops' own, as far as torch's
    recomputation goes (`planner.Region`)."""
    for n, e in replayed_moves(plan, region):
        for c, _, sent in _collectives(edge_sends(e, rank)):
            out.add("recompute", dataclasses.replace(c, where=f"{n.name} input {e.slot}"), sent)
    for k in region.replayed():
        if region.runs_own(k):
            for c, _, sent in _collectives(node_sends(plan.nodes[k], plan.matrix, rank)):
                out.add("recompute", c, sent)


def _edge_traffic(
    out: Traffic, e: EdgePlan, where: str, m: DeviceMatrix, rank: int, needs: set[str]
) -> None:
    """Edge `e`'s collectives (at `where`) and, when its value needs a gradient, their
    adjoints."""
    for item in edge_sends(e, rank):
        if isinstance(item, LocalSlice):
            continue
        c, _, sent = item
        c = dataclasses.replace(c, where=where)
        out.add("forward", c, sent)
        if e.value not in needs:  # (no gradient flows back: no adjoint)
            continue
        if c.kind == "AllReduce":  # (its adjoint, over the axes the plan leaves unequal)
            block = math.prod(e.src.layout.local_shape(e.shape)) * _itemsize(e.dtype)
            # (after a ReduceScatter: on its part of the block)
            block //= math.prod(m.shape[a] for a in e.scatter_axes)
            _adjoint(out, m, rank, c, e.summed, e.equal_grad, block)
        elif c.kind in (AllGather.__name__, AlltoAll.__name__, "ReduceScatter"):  # (exact)
            back = {"AllGather": "ReduceScatter", "ReduceScatter": "AllGather"}.get(c.kind, c.kind)
            out.add("backward", Collective(back, c.axes, c.where), sent)


def _value(node: int, output: int) -> str:
    """The name the plan gives output `output` of node `node` (``"%3"``, ``"%7.1"``)."""
    return f"%{node}" + (f".{output}" if output else "")


def _adjoint(
    out: Traffic,
    m: DeviceMatrix,
    rank: int,
    c: Collective,
    axes: Sequence[int],
    equal: Sequence[int],
    nbytes: int,
) -> None:
    """The backward of an AllReduce over `axes` of an `nbytes` block: an AllReduce of the
    gradient over the axes on which the plan does not make it equal (`equal`)."""
    rest = tuple(a for a in axes if a not in equal)
    if not rest:
        return
    size = len(m.group_along(rank, rest))
    names = tuple(m.names[a] for a in rest)
    out.add(
        "backward", Collective("AllReduce", names, c.where), bytes_bound("AllReduce", nbytes, size)
    )


def _collectives(found: Iterable[Found]) -> list[tuple[Collective, list[int], int]]:
    return [item for item in found if not isinstance(item, LocalSlice)]


def _gradient_sync(out: Traffic, plan: ParallelPlan, level: str, saved: set[str]) -> None:
    """Each bucket of the plan's (`ParallelPlan.buckets`): an AllReduce of the gradients over
    its data-parallel axes, or (optimizer parallel) an AllGather of the weights per forward
    (and again in backward at level 3, when autograd saved a member: `saved`) and a
    ReduceScatter of the gradients over the shard group (then an AllReduce over the copies
    when the shard group is smaller than the data-parallel group)."""
    m = plan.matrix
    sizes = _param_blocks(plan)
    for b in plan.buckets:
        group = math.prod(m.shape[m.names.index(a)] for a in b.axes)
        total = sum(sizes[n] for n in b.params)
        if not b.axes or group <= 1:
            continue
        if b.kind == "allreduce":
            out.add("gradients", Collective("AllReduce", b.axes, "bucket"), _ar(total, group))
            continue
        gathers = 2 if level == "level3" and saved.intersection(b.params) else 1
        for _ in range(gathers):
            sent = bytes_bound("AllGather", total // b.shard, b.shard)
            out.add("weights", Collective("AllGather", b.axes, "bucket"), sent)
        sent = bytes_bound("ReduceScatter", total, b.shard)
        out.add("gradients", Collective("ReduceScatter", b.axes, "bucket"), sent)
        if group > b.shard:
            sent = _ar(total // b.shard, group // b.shard)
            out.add("gradients", Collective("AllReduce", b.axes, "bucket copies"), sent)


def _ar(nbytes: int, group: int) -> int:
    return bytes_bound("AllReduce", nbytes, group)


def format_summary(
    plan: ParallelPlan,
    memory: MemoryEstimate,
    traffic: Traffic,
    header: Sequence[str] = (),
) -> str:
    """The text of ``summary.txt``: memory per kind and the peak, bytes sent per step by
    phase / collective kind / mesh axes with counts, and the step and forward estimates."""
    lines = list(header)
    lines.append(f"plan: {plan.mode}, {plan.device_num} devices on {plan.matrix}")
    lines.append(f"ops: {len(plan.nodes)}, parameters: {len(plan.params)}")
    lines.append("")
    lines.append(f"memory of rank {memory.rank} at its peak (estimate):")
    for kind, nbytes in memory.parts.items():
        lines.append(f"  {kind:<22} {format_size(nbytes):>12}  ({nbytes} B)")
    peak = f"  {'peak':<22} {format_size(memory.peak):>12}  ({memory.peak} B)"
    lines.append(peak + (f" at the {memory.moment}" if memory.moment else ""))
    for name, nbytes in memory.largest:
        lines.append(f"  largest: {name} {format_size(nbytes)}")
    lines.append("")
    lines.append(f"bytes rank {memory.rank} sends per step: {traffic.total}")
    lines.append(f"  {'phase':<10} {'collective':<14} {'axes':<12} {'count':>6} {'bytes':>14}")
    for key in sorted(traffic.sent):
        phase, kind, axes = key
        lines.append(
            f"  {phase:<10} {kind:<14} {axes or '-':<12} {traffic.count[key]:>6} "
            f"{traffic.sent[key]:>14}"
        )
    lines.append("")
    lines.append(f"step estimate (cost model, one training step): {step_cost(plan)}")
    lines.append(f"  of which one forward (the search's objective): {plan_cost(plan)}")
    return "\n".join(lines) + "\n"
