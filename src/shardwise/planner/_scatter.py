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
parts in rank order). The Slices that follow it on the same dim over other reduced axes (a dim
cut over a tuple of axes, ``("sp", "mp")``) run inside the same ReduceScatter, over the group of
all their axes, its ranks ordered as the tuple orders the blocks, first axis outer
(`scatter_cuts`): one collective, as MindSpore runs a tuple dim's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from shardwise.layout import DeviceMatrix
from shardwise.redistribution import Slice, Step

if TYPE_CHECKING:
    from shardwise.planner._edge_plan import EdgePlan


def scatter_cuts(
    steps: Sequence[Step], reduced: Sequence[int], matrix: DeviceMatrix
) -> tuple[Slice, ...]:
    """The first `steps` of a move that can run inside the ReduceScatter of its partial sums
    over `reduced` (none: ``()``): plain Slices of one dim, each over another of those axes,
    longer than 1, on a matrix in rank order (a ReduceScatter hands out parts in rank order).
    The ReduceScatter runs over all their axes, the first outer (the order the Slices cut the
    dim). The planners' cost (`_cost`) and the plan's edges (`EdgePlan.cuts`) both ask this.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> scatter_cuts((Slice(dim=0, axis=1), Slice(dim=0, axis=2)), (1, 2), m)
        (Slice(dim=0, axis=1, groups=1), Slice(dim=0, axis=2, groups=1))
    """
    if matrix.rank_list != tuple(range(matrix.size)):
        return ()
    cuts: list[Slice] = []
    for step in steps:
        if not isinstance(step, Slice) or step.groups != 1 or step.axis not in reduced:
            break
        if matrix.shape[step.axis] <= 1 or (cuts and step.dim != cuts[0].dim):
            break
        cuts.append(step)
    return tuple(cuts)


def scatters(e: EdgePlan) -> bool:
    """Whether edge `e`'s AllReduce and first steps may run as one ReduceScatter.

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
    return bool(scatter_cuts(e.steps, e.reduced, e.src.layout.matrix))


def fuse_scatter(edges: Sequence[EdgePlan]) -> tuple[EdgePlan, ...]:
    """`edges` with each that `scatters` marked `EdgePlan.scatter`.

    Example:
        >>> [e.scatter for e in fuse_scatter(plan_edges)]  # doctest: +SKIP
        [False, True, False]
    """
    return tuple(replace(e, scatter=True) if scatters(e) else e for e in edges)
