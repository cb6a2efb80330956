"""ReduceScatter for a reduction followed by a cut: half the bytes, forward and backward.

A row-parallel layer (Megatron's second linear of an MLP, an attention's output projection)
leaves a partial sum over the model-parallel axis; when the next op wants the rows cut over
that axis (a data-parallel op of the residual stream under sequence-style layouts), the edge
would all-reduce the whole value and then keep one part of it. `fuse_scatter` marks such edges
(`EdgePlan.scatter`) so that the executor runs one ReduceScatter along the cut dim instead
(`parallel._edges.move`): every rank receives the sum of its part only. Its adjoint is an
AllGather of the gradient's parts, where the AllReduce's was an AllReduce of the partial
gradient: both directions send half as much, and the values are the same sums.

An edge qualifies when its first redistribution step is a plain `Slice` over one of the axes
it reduces by sum, and nothing else asks for the AllReduce's form: no weighted mean, seeded or
deferred loss reduction, no gradient the plan knows equal (`EdgePlan.equal_grad`), no value
written back or kept partial, on a device matrix in rank order (a ReduceScatter hands out
parts in rank order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shardwise.layout import DeviceMatrix
from shardwise.planner._edge_plan import EdgePlan
from shardwise.redistribution import Slice, Step


def scatter_cut(first: Step | None, reduced: Sequence[int], matrix: DeviceMatrix) -> bool:
    """Whether a move's `first` step can run inside the ReduceScatter of its partial sums over
    `reduced`: a plain Slice over one of those axes, longer than 1, on a matrix in rank order
    (a ReduceScatter hands out parts in rank order). The planners' cost (`_cost`) and the
    plan's edges (`scatters`) both ask this.

    Example:
        >>> scatter_cut(Slice(dim=0, axis=1), (1,), DeviceMatrix((2, 2), ("dp", "mp")))
        True
    """
    if not isinstance(first, Slice) or first.groups != 1 or first.axis not in reduced:
        return False
    return matrix.shape[first.axis] > 1 and matrix.rank_list == tuple(range(matrix.size))


def scatters(e: EdgePlan) -> bool:
    """Whether edge `e`'s AllReduce and first step may run as one ReduceScatter.

    Example:
        >>> scatters(edge)  # doctest: +SKIP
        True
    """
    if not e.reduced or not e.steps or e.src.reduce != "sum":
        return False
    if e.shared or e.weighted or e.seeded or e.deferred or e.written_back:
        return False
    if e.equal_grad or e.kept:
        return False
    return scatter_cut(e.steps[0], e.reduced, e.src.layout.matrix)


def fuse_scatter(edges: Sequence[EdgePlan]) -> tuple[EdgePlan, ...]:
    """`edges` with each that `scatters` marked `EdgePlan.scatter`.

    Example:
        >>> [e.scatter for e in fuse_scatter(plan_edges)]  # doctest: +SKIP
        [False, True, False]
    """
    return tuple(replace(e, scatter=True) if scatters(e) else e for e in edges)
