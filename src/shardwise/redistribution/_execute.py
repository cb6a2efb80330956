"""The executor: run a `RedistributionPlan` on this rank's local block.

`redistribute` plans (or takes a plan), checks the local block's shape before any collective,
then runs each step on the process group of the step's device axis:

- `Slice` (`_slice`): keep this rank's part of the local block along the dim, chosen by the
  rank's coordinate on the axis (`communication.rank_value`: a rank-dependent int).
- `AllGather` (`_gather`): ``sw.ops.AllGather`` on the dim (moved to dim 0 and back);
  consecutive AllGathers of one plain dim (`gather_runs`) as one over the group of all their
  axes (its blocks ordered first axis outer).
- `AlltoAll` (`_alltoall`): ``sw.ops.AlltoAll`` splitting the destination dim and concatenating
  on the source dim.

Collectives exchange blocks in *sorted* group-rank order; a layout orders them by coordinate
on the axis (`DeviceMatrix.group_along`). When a device matrix's `rank_list` makes the two
differ, the blocks are permuted locally before (AlltoAll) and after (both) the collective.

A strided dim (g groups) holds its block of every group, in group order: a Slice keeps this
rank's part of each group; the pieces a collective sends along a strided dim are first
regrouped so that each destination's part (its piece of every group) is contiguous
(`_by_part`), and what it receives along one is put back in group order (`_by_group`).

Gradients: every step's backward is its exact adjoint (autograd of the primitives and of the
local slice), so autograd computes the true gradient of the sum of all ranks' losses:
AllGather -> ReduceScatter, AlltoAll -> the reverse AlltoAll, Slice -> the gradient in this
rank's part of the block and zeros elsewhere. Gradients of replicated tensors are therefore
*partial*: their sum over the replicas is the gradient of the logical tensor (see
docs/redistribution.md for why an AllGather backward of Slice would be wrong here).

Groups are created once per device matrix and axis (`group_name`): each rank creates the group
it belongs to (`communication.own_group`; only members call `create_group`), all ranks at the
same step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise import communication as comm
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution._plan import RedistributionPlan, plan_redistribution
from shardwise.redistribution._steps import (
    AllGather,
    AlltoAll,
    Slice,
    Step,
    gather_runs,
    run_axes,
)


class _Axes:
    """This rank's view of the device matrix: coordinates and the group of each axis."""

    def __init__(self, layout: TensorLayout) -> None:
        self.matrix = layout.matrix
        self.world = comm.get_group_size()
        for rank in comm.process_ranks():
            if rank not in self.matrix.rank_list:
                raise ValueError(f"redistribute: rank {rank} is not in {self.matrix}")

    def coord(self, axis: int) -> int:
        """This rank's coordinate on `axis` (a rank-dependent int)."""
        return comm.rank_value(lambda r: self.matrix.coord(r)[axis])

    def group(self, *axes: int) -> tuple[str | None, tuple[int, ...]]:
        """The group name of `axes` (first outer) for this rank, and ``order``: the sorted
        position of each block (block j comes from rank ``sorted_group[order[j]]``)."""
        by_block = comm.own_group(lambda r: self.matrix.group_along(r, axes))
        ranks = tuple(sorted(by_block))
        order = tuple(ranks.index(r) for r in by_block)
        if ranks == tuple(range(self.world)):
            return None, order
        return comm.ensure_group(group_name(self.matrix, axes, ranks), ranks), order


def group_name(matrix: DeviceMatrix, axis: int | Sequence[int], ranks: Sequence[int]) -> str:
    """The name of the group of `ranks` along `axis` of `matrix`, the same on every rank.

    Keyed by the matrix and the axis, not by the ranks alone: then every rank of the matrix
    creates its group for an axis at the same step of the same plan, so all processes create
    the same number of process groups in the same order (torch's group names under local
    synchronization count the groups a process has made; reusing a group on some ranks only
    would make the members disagree and hang).
    """
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    names = ",".join(matrix.names[a] for a in axes)
    return comm.scoped_group_name(f"redistribution:{names}", str(matrix), ranks)


def _permute(x: torch.Tensor, dim: int, order: Sequence[int]) -> torch.Tensor:
    """Chunk j of the result is chunk ``order[j]`` of `x` along `dim`."""
    if tuple(order) == tuple(range(len(order))):
        return x
    chunks = x.chunk(len(order), dim)
    return torch.cat([chunks[i] for i in order], dim)


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for j, p in enumerate(order):
        inv[p] = j
    return tuple(inv)


def _by_part(x: torch.Tensor, dim: int, groups: int, parts: int) -> torch.Tensor:
    """`dim` holds `groups` groups each of `parts` pieces: reorder it to `parts` parts each
    holding its piece of every group (part j contiguous)."""
    if groups == 1:
        return x
    n = x.shape[dim]
    y: torch.Tensor = x.unflatten(dim, (groups, parts, n // (groups * parts)))
    return y.transpose(dim, dim + 1).flatten(dim, dim + 2)


def _by_group(x: torch.Tensor, dim: int, groups: int, parts: int) -> torch.Tensor:
    """The inverse of `_by_part`: `parts` parts each holding a piece of every group, back to
    `groups` groups each of `parts` pieces."""
    if groups == 1:
        return x
    n = x.shape[dim]
    y: torch.Tensor = x.unflatten(dim, (parts, groups, n // (groups * parts)))
    return y.transpose(dim, dim + 1).flatten(dim, dim + 2)


def _slice(x: torch.Tensor, step: Slice, axes: _Axes) -> torch.Tensor:
    k = axes.matrix.shape[step.axis]
    n = x.shape[step.dim] // k
    parts = comm.every_rank(_by_part(x, step.dim, step.groups, k))  # (a constant: per rank)
    return parts.narrow(step.dim, axes.coord(step.axis) * n, n)


def _gather(
    x: torch.Tensor, step: AllGather, axes: _Axes, over: Sequence[int] = ()
) -> torch.Tensor:
    """`step`, or with `over` one AllGather of `step.dim` over those axes (first outer)."""
    group, order = axes.group(*(over or (step.axis,)))
    y = comm.AllGather(group)(x.movedim(step.dim, 0))
    y = _permute(y, 0, order).movedim(0, step.dim)
    return _by_group(y, step.dim, step.groups, len(order))


def _alltoall(x: torch.Tensor, step: AlltoAll, axes: _Axes) -> torch.Tensor:
    group, order = axes.group(step.axis)
    k = len(order)
    send = _permute(_by_part(x, step.dst_dim, step.dst_groups, k), step.dst_dim, _inverse(order))
    y = comm.AlltoAll(k, step.dst_dim, step.src_dim, group)(send)
    return _by_group(_permute(y, step.src_dim, order), step.src_dim, step.src_groups, k)


def _run(x: torch.Tensor, step: Step, axes: _Axes) -> torch.Tensor:
    if axes.matrix.shape[step.axis] == 1:
        return x
    if isinstance(step, Slice):
        return _slice(x, step, axes)
    if isinstance(step, AllGather):
        return _gather(x, step, axes)
    return _alltoall(x, step, axes)


def redistribute(
    local: torch.Tensor,
    src: TensorLayout,
    dst: TensorLayout,
    shape: Sequence[int],
    plan: RedistributionPlan | None = None,
) -> torch.Tensor:
    """Move this rank's block of a tensor from layout `src` to layout `dst`.

    Every rank of the device matrix calls it with its own block. Autograd flows back through
    the steps (see the module docstring for the gradient convention).

    Args:
        local: this rank's block under `src` (shape ``src.local_shape(shape)``).
        src: the layout `local` is in.
        dst: the layout to produce; same device matrix.
        shape: the tensor's global shape.
        plan: a plan from `plan_redistribution(src, dst, shape, itemsize)` to reuse, with
            ``itemsize == local.element_size()``; planned if None.

    Returns:
        This rank's block under `dst`: ``global[dst.local_slice(rank, shape)]``.

    Raises:
        ValueError: before any collective, when `local` has the wrong shape, `plan` is for other
            layouts or another itemsize than `local`'s, the layouts do not fit `shape`, or this
            rank is not in the device matrix.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> src, dst = TensorLayout(m, ((0,), (), ())), TensorLayout(m, ((2,), (1, 0), ()))
        >>> y = redistribute(x_local, src, dst, (8, 8, 8))
    """
    shape = tuple(shape)
    if plan is None:
        plan = plan_redistribution(src, dst, shape, local.element_size())
    elif (plan.src, plan.dst, plan.shape) != (src, dst, shape):
        raise ValueError(
            f"redistribute: the plan is for {plan.src} -> {plan.dst} with shape "
            f"{list(plan.shape)}, not {src} -> {dst} with shape {list(shape)}"
        )
    elif plan.itemsize != local.element_size():
        raise ValueError(
            f"redistribute: the plan was made for itemsize={plan.itemsize} but the local block "
            f"({local.dtype}) has itemsize {local.element_size()}, so the plan's bytes would not "
            f"be what runs; plan with plan_redistribution(src, dst, shape, "
            f"itemsize={local.element_size()}) (x.element_size())"
        )
    want = src.local_shape(shape)
    if tuple(local.shape) != want:
        raise ValueError(
            f"redistribute: the local block has shape {list(local.shape)} but layout {src} "
            f"gives each rank a block of {list(want)} for global shape {list(shape)}"
        )
    if all(src.matrix.shape[step.axis] == 1 for step in plan.steps):
        return local  # nothing to do (also without a process group)
    axes = _Axes(src)
    x = local
    for run in gather_runs(plan.steps, src.matrix.shape):
        if len(run) > 1:  # (one AllGather over the axes of a dim gathered together)
            first = run[0]
            assert isinstance(first, AllGather), "a run of several steps gathers"
            x = _gather(x, first, axes, run_axes(run))
        else:
            x = _run(x, run[0], axes)
    return x


def block_offset(layout: TensorLayout, dim: int, shape: Sequence[int]) -> int:
    """Where this rank's block of `dim` starts in the global tensor (a rank-dependent int).

    Example:
        >>> block_offset(TensorLayout(m, ((0,), ())), 0, (16, 4))   # rank 5 on (2, 4): 8
    """
    if layout.groups_of(dim) > 1:
        raise ValueError(f"block_offset: dim {dim} of {layout} is strided (several ranges)")
    axes = _Axes(layout)
    index = 0
    for a in layout.dims[dim]:
        index = index * layout.matrix.shape[a] + axes.coord(a)
    return index * (int(shape[dim]) // layout.split_count(dim))


def local_block(whole: torch.Tensor, layout: TensorLayout, shape: Sequence[int]) -> torch.Tensor:
    """This rank's block under `layout` of a tensor every rank holds whole (local slices only,
    no collective).

    Example:
        >>> block = local_block(weight, layout, weight.shape)
    """
    replicated = TensorLayout(layout.matrix, ((),) * len(shape))
    return redistribute(whole, replicated, layout, shape)
