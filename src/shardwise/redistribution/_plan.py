"""The planner: the cheapest list of steps from one layout to another, without a process group.

`plan_redistribution` runs Dijkstra over layout states (each state is the per-dim tuple of
splitting axes; edges are the legal `Slice` / `AllGather` / `AlltoAll` steps of `_steps`, weighted
by the bytes each rank sends). Ties are broken by fewer steps, then by the step order of
`step_key` (lexicographically over the whole sequence), so a plan is deterministic. The order
(bytes, steps, sequence) grows strictly when a step is appended, hence Dijkstra's settled path to
each state is the minimum in that order and the predecessor chain reconstructs it.

`RedistributionPlan` holds the result: the steps, the layout after each, the bytes per rank of
each and in total; `str(plan)` prints one line per step.

Strided layouts (`TensorLayout.groups`): within one search every dim keeps one group count
(`_phases`), the count of whichever layout splits it. A dim that both layouts split with
different counts is first gathered whole (a first search, from `src` to `src` without those
dims' axes), then split again as `dst` wants (a second search).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution._steps import (
    Dims,
    Slice,
    Step,
    apply_dims,
    gather_runs,
    legal_steps,
    run_axes,
    step_bytes,
    step_key,
)

StepKey = tuple[int, int, int, int]
Key = tuple[int, int, tuple[StepKey, ...]]
Edge = tuple[Step, Dims, int, StepKey]


@dataclass(frozen=True)
class RedistributionPlan:
    """How a tensor moves from layout `src` to layout `dst`.

    Attributes:
        src: the starting layout.
        dst: the final layout (same device matrix).
        shape: the tensor's global shape.
        itemsize: bytes per element the costs assume.
        steps: the steps, in order.
        layouts: the layout after each step (``layouts[-1] == dst`` when there are steps).
        step_bytes: bytes each rank sends in each step.

    Example:
        >>> plan = plan_redistribution(src, dst, (8, 8, 8))
        >>> print(plan)
        >>> plan.total_bytes, [str(s) for s in plan.steps]
    """

    src: TensorLayout
    dst: TensorLayout
    shape: tuple[int, ...]
    itemsize: int
    steps: tuple[Step, ...]
    layouts: tuple[TensorLayout, ...]
    step_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes each rank sends over the whole plan."""
        return sum(self.step_bytes)

    def collectives(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """The collectives `rank` issues, in order: (kind, sorted global ranks of the group).

        Slices and steps over an axis of size 1 issue none; AllGathers of one dim gathered
        together (`gather_runs`) one over the group of all their axes.
        """
        out = []
        matrix = self.src.matrix
        for run in gather_runs(self.steps, matrix.shape):
            step = run[0]
            if isinstance(step, Slice) or matrix.shape[step.axis] == 1:
                continue
            group = tuple(sorted(matrix.group_along(rank, run_axes(run))))
            out.append((type(step).__name__, group))
        return out

    def __str__(self) -> str:
        matrix = self.src.matrix
        head = (
            f"{layout_map(self.src)} -> {layout_map(self.dst)} on {matrix}, "
            f"shape {list(self.shape)}: {len(self.steps)} step(s), "
            f"{format_bytes(self.total_bytes)}/rank"
        )
        lines = [head]
        for i, (step, after, nbytes) in enumerate(
            zip(self.steps, self.layouts, self.step_bytes, strict=True), 1
        ):
            cost = f"{format_bytes(nbytes)}/rank"
            lines.append(f"  {i}. {step.describe(matrix):<48} {cost:>14}  -> {layout_map(after)}")
        return "\n".join(lines)


def layout_map(layout: TensorLayout) -> str:
    """A layout's tensor map alone, e.g. ``(mp, (sp, dp), None)``."""

    def one(d: int, axes: tuple[int, ...]) -> str:
        names = [layout.matrix.names[a] for a in axes]
        if not names:
            return "None"
        text = names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
        g = layout.groups_of(d)
        return f"strided({text}, {g})" if g > 1 else text

    return "(" + ", ".join(one(d, axes) for d, axes in enumerate(layout.dims)) + ")"


def format_bytes(n: int) -> str:
    """``512 B``, ``4.0 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _validate(src: TensorLayout, dst: TensorLayout, shape: Sequence[int], itemsize: int) -> None:
    if src.matrix != dst.matrix:
        raise ValueError(
            f"redistribution: src and dst must be on the same device matrix; got {src.matrix} "
            f"and {dst.matrix}"
        )
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"redistribution: itemsize={itemsize!r} must be an int >= 1")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"redistribution: shape {list(shape)} must be ints >= 0")
    src.check(shape, "redistribution source")
    dst.check(shape, "redistribution destination")


@functools.lru_cache(maxsize=1 << 16)
def _edges(
    dims: Dims,
    sizes: tuple[int, ...],
    shape: tuple[int, ...],
    itemsize: int,
    groups: tuple[int, ...] = (),
) -> tuple[Edge, ...]:
    """The steps out of layout `dims` (each dim cut in `groups`): (step, next layout, bytes
    per rank, order key).

    Cached: planning many tensors of the same shape on one matrix walks the same graph.
    """
    return tuple(
        (
            step,
            apply_dims(dims, step, len(sizes)),
            step_bytes(dims, step, sizes, shape, itemsize),
            step_key(step),
        )
        for step in legal_steps(dims, sizes, shape, groups)
    )


def _lower_bound(
    dims: Dims, dst: Dims, sizes: tuple[int, ...], shape: tuple[int, ...], itemsize: int
) -> int:
    """Bytes still to send from `dims` to `dst`, at least (A*'s consistent heuristic).

    Each axis past the common prefix of a dim's axes in `dims` and in `dst` must be gathered
    or moved at least once, which costs at least (k-1)/k of the smallest possible block (the
    tensor split over every axis). A step lowers the bound by no more than it costs.
    """
    smallest = itemsize * math.prod(shape) // math.prod(sizes)
    total = 0
    for have, want in zip(dims, dst, strict=True):
        prefix = 0
        while prefix < min(len(have), len(want)) and have[prefix] == want[prefix]:
            prefix += 1
        total += sum((sizes[a] - 1) * smallest // sizes[a] for a in have[prefix:])
    return total


def _search(
    matrix: DeviceMatrix,
    src: Dims,
    dst: Dims,
    shape: tuple[int, ...],
    itemsize: int,
    groups: tuple[int, ...] = (),
) -> list[Step]:
    """A* from `src` to `dst` under the (bytes, steps, sequence) order (each dim cut in its
    `groups`)."""
    sizes = matrix.shape
    best: dict[Dims, Key] = {src: (0, 0, ())}
    back: dict[Dims, tuple[Dims, Step]] = {}
    heap: list[tuple[int, Key, Dims]] = [(0, (0, 0, ()), src)]
    done: set[Dims] = set()
    while heap:
        _, key, dims = heapq.heappop(heap)
        if dims == dst:
            break
        if dims in done:
            continue
        done.add(dims)
        nbytes, nsteps, seq = key
        for step, nxt, cost, order in _edges(dims, sizes, shape, itemsize, groups):
            if nxt in done:
                continue
            new: Key = (nbytes + cost, nsteps + 1, (*seq, order))
            if nxt not in best or new < best[nxt]:
                best[nxt], back[nxt] = new, (dims, step)
                bound = new[0] + _lower_bound(nxt, dst, sizes, shape, itemsize)
                heapq.heappush(heap, (bound, new, nxt))
    steps: list[Step] = []
    at = dst
    while at != src:
        at, step = back[at]
        steps.append(step)
    return steps[::-1]


def plan_redistribution(
    src: TensorLayout, dst: TensorLayout, shape: Sequence[int], itemsize: int = 4
) -> RedistributionPlan:
    """The cheapest plan that moves a tensor of global `shape` from layout `src` to `dst`.

    Pure: no process group, no tensors. The plan minimizes the bytes each rank sends (sum of
    the steps' bounds), then the number of steps, then the step order (deterministic).

    Args:
        src: the layout the tensor has.
        dst: the layout it must get; same device matrix as `src`.
        shape: the tensor's global shape; both layouts must divide it.
        itemsize: bytes per element (4 for float32).

    Returns:
        A `RedistributionPlan` (no steps when `src == dst`).

    Raises:
        ValueError: different device matrices, a layout that does not divide `shape` or has
            the wrong number of dims, a bad `itemsize`.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> src = TensorLayout(m, ((0,), (1,), (2,)))
        >>> dst = TensorLayout(m, ((2,), (1, 0), ()))     # (mp, (sp, dp), None)
        >>> print(plan_redistribution(src, dst, (8, 8, 8)))
    """
    shape = tuple(shape)
    _validate(src, dst, shape, itemsize)
    steps: list[Step] = []
    layouts, costs = [], []
    for start, end, groups in _phases(src, dst):
        dims = start.dims
        for step in _search(src.matrix, start.dims, end.dims, shape, itemsize, groups):
            costs.append(step_bytes(dims, step, src.matrix.shape, shape, itemsize))
            dims = apply_dims(dims, step, len(src.matrix.shape))
            layouts.append(TensorLayout(src.matrix, dims, groups))
            steps.append(step)
    return RedistributionPlan(src, dst, shape, itemsize, tuple(steps), tuple(layouts), tuple(costs))


def _phases(
    src: TensorLayout, dst: TensorLayout
) -> list[tuple[TensorLayout, TensorLayout, tuple[int, ...]]]:
    """The searches from `src` to `dst`, each with one group count per dim (empty: plain).

    One search when no dim is split by both layouts with different group counts; else two:
    first those dims gathered whole, then on to `dst`.
    """
    if not src.groups and not dst.groups:
        return [(src, dst, ())]
    n = src.ndim

    def counts(a: TensorLayout, b: TensorLayout) -> tuple[int, ...]:
        return tuple(a.groups_of(d) if a.split_count(d) > 1 else b.groups_of(d) for d in range(n))

    clash = [
        d
        for d in range(n)
        if src.split_count(d) > 1
        and dst.split_count(d) > 1
        and src.groups_of(d) != dst.groups_of(d)
    ]
    if not clash:
        return [(src, dst, counts(src, dst))]
    dims = tuple(() if d in clash else axes for d, axes in enumerate(src.dims))
    mid = TensorLayout(src.matrix, dims, tuple(src.groups_of(d) for d in range(n)))
    return [(src, mid, counts(src, mid)), (mid, dst, counts(mid, dst))]
