"""The three redistribution steps and their pure algebra on layouts.

A layout lists, for each tensor dim, the device axes splitting it, outer first. A step changes
one axis of one dim, and only ever the *innermost* one (the last of a dim's axes):

- `Slice(dim, axis)`: a replicated `axis` starts splitting `dim`, as its new innermost axis.
  Each rank keeps its part of its local block: no communication.
- `AllGather(dim, axis)`: the innermost `axis` of `dim` stops splitting it; the ranks along
  `axis` concatenate their blocks.
- `AlltoAll(axis, src_dim, dst_dim)`: the innermost `axis` of `src_dim` becomes the innermost
  axis of `dst_dim`; the ranks along `axis` exchange parts of their blocks.

Why innermost only: the ranks along the innermost axis of a dim hold *adjacent* blocks, so
concatenating them gives one contiguous block. The ranks along an outer axis hold blocks that
are a whole inner-stride apart; gathering them yields a strided set of pieces that is not the
block of any layout.

A strided dim (`TensorLayout.groups`: cut into g groups, each split over the dim's axes) moves
the same way inside every group: each step carries the group count of the dim(s) it touches
(`Slice.groups`, `AllGather.groups`, `AlltoAll.src_groups` / `dst_groups`; 1 for a plain dim),
and `legal_steps` takes them per dim (fixed while one plan runs: `_plan` changes a dim's groups
only by gathering it whole first).

`apply_step` moves a layout by one step (pure), `legal_steps` lists the steps that may follow a
layout for a global shape, `step_bytes` is a step's cost: the bytes each rank sends by the
collective's bound (`communication.bytes_bound`): AllGather over k ranks of an s-byte block
(k-1)·s, AlltoAll (k-1)/k·s, Slice 0.

`gather_runs` groups a plan's steps as they run: consecutive AllGathers of one plain dim (its
innermost axes, innermost first: a dim split over a tuple of axes gathered over several of them)
run as one AllGather over the group of all their axes, its ranks ordered as the dim's blocks
(first axis outer), as MindSpore gathers a tuple dim; it sends the bytes of the steps together,
(k1·k2-1)·s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardwise.layout import DeviceMatrix, TensorLayout

Dims = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Slice:
    """Split `dim` further by the replicated device axis `axis` (no communication).

    Example:
        >>> Slice(dim=0, axis=2)      # axis 2 becomes dim 0's innermost axis
    """

    dim: int
    axis: int
    groups: int = 1

    def describe(self, matrix: DeviceMatrix) -> str:
        """The step with the axis name, e.g. ``Slice(dim=0, axis=mp, 2 parts)`` (``, in each
        of 3 groups`` for a strided dim)."""
        name, k = matrix.names[self.axis], matrix.shape[self.axis]
        return f"Slice(dim={self.dim}, axis={name}, {k} parts{_in_groups(self.groups)})"

    def __str__(self) -> str:
        return f"Slice(dim={self.dim}, axis={self.axis}{_groups(self.groups)})"


@dataclass(frozen=True)
class AllGather:
    """Undo `dim`'s innermost axis `axis`: the ranks along it concatenate their blocks.

    Example:
        >>> AllGather(dim=1, axis=0)
    """

    dim: int
    axis: int
    groups: int = 1

    def describe(self, matrix: DeviceMatrix) -> str:
        axis = _axis(matrix, self.axis)
        return f"AllGather(dim={self.dim}, axis={axis}{_in_groups(self.groups)})"

    def __str__(self) -> str:
        return f"AllGather(dim={self.dim}, axis={self.axis}{_groups(self.groups)})"


@dataclass(frozen=True)
class AlltoAll:
    """Move `src_dim`'s innermost axis `axis` to be `dst_dim`'s innermost axis.

    Example:
        >>> AlltoAll(axis=2, src_dim=2, dst_dim=0)
    """

    axis: int
    src_dim: int
    dst_dim: int
    src_groups: int = 1
    dst_groups: int = 1

    def describe(self, matrix: DeviceMatrix) -> str:
        src = f"{self.src_dim}{_strided(self.src_groups)}"
        dst = f"{self.dst_dim}{_strided(self.dst_groups)}"
        return f"AlltoAll(dim {src} -> {dst}, axis={_axis(matrix, self.axis)})"

    def __str__(self) -> str:
        groups = ""
        if (self.src_groups, self.dst_groups) != (1, 1):
            groups = f", src_groups={self.src_groups}, dst_groups={self.dst_groups}"
        return f"AlltoAll(axis={self.axis}, src_dim={self.src_dim}, dst_dim={self.dst_dim}{groups})"


Step = Slice | AllGather | AlltoAll


def _axis(matrix: DeviceMatrix, axis: int) -> str:
    name = matrix.names[axis]
    return f"{name}, group size {matrix.shape[axis]}"


def _in_groups(groups: int) -> str:
    return f", in each of {groups} groups" if groups > 1 else ""


def _groups(groups: int) -> str:
    return f", groups={groups}" if groups > 1 else ""


def _strided(groups: int) -> str:
    return f" ({groups} groups)" if groups > 1 else ""


def step_key(step: Step) -> tuple[int, int, int, int]:
    """A total order on steps (the planner's final tie-break): AllGather, AlltoAll, Slice."""
    if isinstance(step, AllGather):
        return (0, step.dim, step.axis, 0)
    if isinstance(step, AlltoAll):
        return (1, step.src_dim, step.dst_dim, step.axis)
    return (2, step.dim, step.axis, 0)


def apply_dims(dims: Dims, step: Step, n_axes: int) -> Dims:
    """`apply_step` on the raw per-dim axis tuples of a layout (the planner's fast path).

    Raises:
        ValueError: the step does not apply to `dims` (names the reason).
    """
    out = list(dims)

    def check_dim(d: int) -> None:
        if not 0 <= d < len(dims):
            raise ValueError(f"{step}: dim {d} is not a dim of a {len(dims)}-d layout {dims}")

    if isinstance(step, Slice):
        check_dim(step.dim)
        if not 0 <= step.axis < n_axes or any(step.axis in axes for axes in dims):
            raise ValueError(f"{step}: axis {step.axis} is not a replicated axis of {dims}")
        out[step.dim] = (*dims[step.dim], step.axis)
        return tuple(out)
    src = step.dim if isinstance(step, AllGather) else step.src_dim
    check_dim(src)
    if not dims[src] or dims[src][-1] != step.axis:
        raise ValueError(
            f"{step}: axis {step.axis} is not the innermost axis of dim {src} in {dims}; "
            "only a dim's innermost axis can be gathered or moved"
        )
    out[src] = dims[src][:-1]
    if isinstance(step, AlltoAll):
        check_dim(step.dst_dim)
        if step.dst_dim == src:
            raise ValueError(f"{step}: src_dim and dst_dim must differ")
        out[step.dst_dim] = (*dims[step.dst_dim], step.axis)
    return tuple(out)


def apply_step(layout: TensorLayout, step: Step) -> TensorLayout:
    """The layout after `step` (pure; no tensors, no process group).

    Args:
        layout: the layout before the step.
        step: a `Slice`, `AllGather` or `AlltoAll`.

    Returns:
        The layout after the step, on the same device matrix.

    Raises:
        ValueError: the step does not apply (e.g. the axis is not the dim's innermost one).

    Example:
        >>> m = DeviceMatrix((2, 2), ("dp", "mp"))
        >>> str(apply_step(TensorLayout(m, ((0,), ())), AlltoAll(0, 0, 1)))
        '(None, dp) on DeviceMatrix(dp=2, mp=2)'
    """
    dims = apply_dims(layout.dims, step, len(layout.matrix.shape))
    groups = [layout.groups_of(d) for d in range(layout.ndim)]
    if isinstance(step, Slice):
        groups[step.dim] = step.groups
    elif isinstance(step, AlltoAll):
        groups[step.dst_dim] = step.dst_groups
    return TensorLayout(layout.matrix, dims, tuple(groups))


def _parts(dims: Dims, d: int, sizes: Sequence[int]) -> int:
    return math.prod(sizes[a] for a in dims[d])


def legal_steps(
    dims: Dims, sizes: Sequence[int], shape: Sequence[int], groups: Sequence[int] = ()
) -> Iterator[Step]:
    """Every step that may follow `dims` for a tensor of global `shape` on a matrix of `sizes`:
    gathers and moves of each dim's innermost axis, slices by each replicated axis, keeping
    every dim divisible by its number of parts (times its strided `groups`, one count per dim;
    empty: all 1)."""
    g = tuple(groups) or (1,) * len(dims)
    used = {a for axes in dims for a in axes}
    for d, axes in enumerate(dims):
        if axes:
            a = axes[-1]
            yield AllGather(d, a, g[d])
            for e in range(len(dims)):
                if e != d and shape[e] % (g[e] * _parts(dims, e, sizes) * sizes[a]) == 0:
                    yield AlltoAll(a, d, e, g[d], g[e])
        for a, k in enumerate(sizes):
            if a not in used and shape[d] % (g[d] * _parts(dims, d, sizes) * k) == 0:
                yield Slice(d, a, g[d])


def block_bytes(dims: Dims, sizes: Sequence[int], shape: Sequence[int], itemsize: int) -> int:
    """Bytes of each rank's local block under `dims`."""
    return itemsize * math.prod(n // _parts(dims, d, sizes) for d, n in enumerate(shape))


def step_bytes(
    dims: Dims, step: Step, sizes: Sequence[int], shape: Sequence[int], itemsize: int
) -> int:
    """Bytes each rank sends for `step` from layout `dims` (the collective's bound).

    AllGather over k ranks of an s-byte local block: (k-1)·s; AlltoAll: (k-1)/k·s (exact: the
    destination dim's local size divides by k); Slice: 0.
    """
    if isinstance(step, Slice):
        return 0
    s = block_bytes(dims, sizes, shape, itemsize)
    k = sizes[step.axis]
    return (k - 1) * s if isinstance(step, AllGather) else (k - 1) * s // k


def gather_runs(steps: Sequence[Step], sizes: Sequence[int]) -> tuple[tuple[Step, ...], ...]:
    """`steps` grouped as the executor runs them: consecutive AllGathers of one plain dim
    (groups 1), each over an axis longer than 1, as one run (one AllGather over all their axes:
    `run_axes`); every other step a run of its own.

    Example:
        >>> [len(r) for r in gather_runs((AllGather(0, 2), AllGather(0, 1), Slice(1, 2)), (2,) * 3)]
        [2, 1]
    """
    out: list[tuple[Step, ...]] = []
    for step in steps:
        last = out[-1] if out else ()
        if _joins(last, step, sizes):
            out[-1] = (*last, step)
        else:
            out.append((step,))
    return tuple(out)


def _joins(run: tuple[Step, ...], step: Step, sizes: Sequence[int]) -> bool:
    """Whether `step` gathers the same plain dim as every AllGather of `run`."""
    if not run or not isinstance(step, AllGather) or step.groups != 1 or sizes[step.axis] == 1:
        return False
    first = run[0]
    if not isinstance(first, AllGather) or first.groups != 1 or sizes[first.axis] == 1:
        return False
    return first.dim == step.dim


def run_axes(run: Sequence[Step]) -> tuple[int, ...]:
    """The axes of a run of `gather_runs`, outer first (the order its one AllGather's group
    orders the blocks): the steps' axes reversed (they gather innermost first)."""
    return tuple(step.axis for step in reversed(run))


def describe_run(run: Sequence[Step], matrix: DeviceMatrix) -> str:
    """A run of `gather_runs` with the axis names: its step's `describe`, or for several
    AllGathers ``AllGather(dim=0, axis=(sp, mp), group size 4)``."""
    if len(run) == 1:
        return run[0].describe(matrix)
    axes = run_axes(run)
    names = ", ".join(matrix.names[a] for a in axes)
    k = math.prod(matrix.shape[a] for a in axes)
    first = run[0]
    assert isinstance(first, AllGather), "a run of several steps gathers"
    return f"AllGather(dim={first.dim}, axis=({names}), group size {k})"
