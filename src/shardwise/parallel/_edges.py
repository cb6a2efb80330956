"""Moving values as a `ParallelPlan` says, on this rank (used by `_executor.PlanExecutor`).

- `move`: one edge (`planner.EdgePlan`): the AllReduce of partial values, then the Slice /
  AllGather / AlltoAll steps, then `_keep_first` for a whole value wanted partial; an edge that
  is only the AllReduce can be started and finished later (the executor's returned loss); an
  edge whose AllReduce and first Slices run as one ReduceScatter (`EdgePlan.scatter`):
  `_scatter`.
- `run_collective`: an op's own collective (`planner.NodePlan.comms`), through
  `_runtime.combine`.
- `grad_route`: the adjoint of such an AllReduce when the plan says its result's gradient is
  the same on the ranks of some of its axes (`equal_grad`): the AllReduce over the others only.
- `average_outputs`: the AllReduce(avg)s of an op's output gradients in backward
  (`NodePlan.backward`, Megatron's ``f``).
- `copied_moves`: the nodes whose moved input is copied before an in-place op changes it
  (the move hands over a view, which autograd may refuse to change in place).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.communication.primitives import GradRoute, average_gradient, sum_over_ranks
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.parallel._runtime import combine, group_for
from shardwise.planner import Collective, EdgePlan, NodePlan
from shardwise.redistribution import local_block, redistribute

T = torch.Tensor


def move(
    x: T,
    edge: EdgePlan,
    started: list[Callable[[], None]] | None = None,
    weight: T | None = None,
    run: object | None = None,
    defer: bool = False,
) -> T:
    """`x` (this rank's part of the edge's value) moved as `edge` says; with `started`, an edge
    that is only an AllReduce is only started (`sum_over_ranks`: finished by the function it
    appends there). With `weight` (a mean loss's counted targets on this rank: `loss_weight`),
    `x` is this rank's loss summed (`_local.summed_loss`), and the result the ranks' sum over
    their summed weight, the single-device mean. `run`:
    the executor's current run of the plan (what a ``seeded`` AllReduce is marked with);
    `defer`: the gradients' reducer corrects a backward that did not wait for the count, so a
    ``deferred`` edge's backward need not wait (`communication.sum_over_ranks`)."""
    m = edge.src.layout.matrix
    if edge.cuts:
        return _scatter(x, edge)
    if edge.reduced:
        group, members = group_for(m, edge.reduced)
        divisor = len(members) if edge.src.reduce == "avg" else 1
        route = grad_route(m, edge.reduced, edge.equal_grad)
        only = not edge.steps and not edge.kept
        seeded = run if edge.seeded else None  # (`EdgePlan.seeded`, marked with this run)
        later = defer and edge.deferred
        x = sum_over_ranks(
            x, group, divisor, route, started if only else None, weight, seeded, later
        )
    if edge.steps:
        x = redistribute(x, edge.src.layout, edge.dst.layout, edge.shape)
    if edge.kept:
        x = _keep_first(x, m, edge.kept)
    return x


def copied_moves(edges: Mapping[tuple[int, int], EdgePlan], changes: set[int]) -> set[int]:
    """The in-place nodes (`changes`) whose moved input 0 is given as a fresh copy
    (`_node_run._moved_inputs`): their own move hands over a view (`Slice`'s narrow of the
    network's tensor, the reorders of an AllGather's or AlltoAll's result, a whole value made
    partial: `_keep_first`), which autograd refuses to change in place when a collective's
    autograd Function made it. An AllReduce alone gives a tensor of its own: no copy. (A change
    through a view of a moved value, ``sw.shard``'s input strategy included, is refused at plan
    time: `planner._in_place.check_change`.)"""
    return {k for k in changes if (e := edges.get((k, 0))) is not None and (e.steps or e.kept)}


def _scatter(x: T, edge: EdgePlan) -> T:
    """Edge `edge` with its AllReduce and first Slices as one ReduceScatter (`EdgePlan.scatter`)
    over the Slices' axes (its group's ranks in the order they cut the dim, first outer): this
    rank receives the sum of its part; the AllReduce over the other reduced axes (on the part),
    then the rest of the steps."""
    m, cuts = edge.src.layout.matrix, edge.cuts
    assert cuts, "an edge with a scatter"
    x = combine(x, "ReduceScatter", "sum", cuts[0].dim, m, list(edge.scatter_axes), edge)
    if edge.summed:
        group, _ = group_for(m, edge.summed)
        x = sum_over_ranks(x, group)
    if len(edge.steps) > len(cuts):
        x = redistribute(x, edge.after_scatter, edge.dst.layout, edge.shape)
    return x


def run_collective(x: T, c: Collective, matrix: DeviceMatrix) -> T:
    """An op's own collective (`NodePlan.comms`): AllReduce (sum / mean) or ReduceScatter (sum,
    along `c.dim`) over the plan's axes `c.axes`."""
    axes = [matrix.axis(a) for a in c.axes]
    route = grad_route(matrix, axes, [matrix.axis(a) for a in c.equal_grad])
    return combine(x, c.kind, c.detail, c.dim, matrix, axes, c, route)


def grad_route(matrix: DeviceMatrix, axes: Sequence[int], equal: Sequence[int]) -> GradRoute | None:
    """The adjoint of an AllReduce over `axes` whose result's gradient is the same on the ranks
    of `equal` (None: none is): the AllReduce over the other axes, times the `equal` ranks."""
    if not equal:
        return None
    rest = [a for a in axes if a not in equal]
    group, members = group_for(matrix, rest) if rest else (None, (0,))
    return GradRoute(group, len(members) > 1, math.prod(matrix.shape[a] for a in equal))


def average_outputs(out: Any, node: NodePlan, matrix: DeviceMatrix) -> None:
    """Register `node`'s AllReduce(avg)s (``NodePlan.backward``) on the gradients of its
    outputs `out` (a tensor, or a structure of them in the node's output order)."""
    tensors = [out] if isinstance(out, T) else pytree.tree_leaves(out)
    tensors = [t for t in tensors if isinstance(t, T)]
    for c in node.backward:
        group, _ = group_for(matrix, [matrix.axis(a) for a in c.axes])
        average_gradient(tensors[c.output], group)


def _keep_first(x: T, matrix: DeviceMatrix, axes: tuple[int, ...]) -> T:
    """`x` on the ranks at coordinate 0 of `axes`, zeros on the others (a whole value made a
    partial sum over `axes`); the gradient reaches `x` from the first ranks only."""
    count = 1
    for a in axes:
        count *= matrix.shape[a]
    stacked = torch.cat([x.unsqueeze(0), x.new_zeros((count - 1, *x.shape))])
    layout = TensorLayout(matrix, (axes,) + ((),) * x.dim())
    return local_block(stacked, layout, tuple(stacked.shape)).squeeze(0)
