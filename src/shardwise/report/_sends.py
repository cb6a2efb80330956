"""What each rank sends: the collectives of a `planner.ParallelPlan` with one rank's group and
the bytes it sends, and the local slices of its edges (nothing sent).

- `LocalSlice`: one rank's ``StridedSlice`` of a Slice step (consecutive ones joined by `then`).
- `edge_sends`: an edge's AllReduce of partial sums, then its redistribution steps, in order.
- `node_sends`: an op's own collectives (a primitive's AllReduce / ReduceScatter).
- `fmt_slice`: the block a rank holds, as text.

Bytes are each collective's bound (`communication.recorder.bytes_bound`) on this rank's block.
Both `execute.ir` (`_parallel_plan`) and the plan pictures (`_html`, `_png`) list them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import Collective, EdgePlan, NodePlan
from shardwise.redistribution import Slice, gather_runs, plan_redistribution, run_axes


@dataclass(frozen=True)
class LocalSlice:
    """A `Slice` step of an edge on one rank: a local ``StridedSlice`` of the block it holds.

    Attributes:
        step: the step as the plan prints it, ``Slice(dim=1, axis=g1, 4 parts)``.
        begin, end: the kept range, per dim, in the coordinates of this rank's block before
            the step (MindSpore's ``StridedSlice(x, begin, end, strides)``, strides 1).
        local: this rank's block shape before the step.
        groups: per dim, the strided group count (``()``: plain): the kept range is then
            the same in each group's piece of the block, and `begin` / `end` are within it.
    """

    step: str
    begin: tuple[int, ...]
    end: tuple[int, ...]
    local: tuple[int, ...]
    groups: tuple[int, ...] = ()

    def then(self, later: LocalSlice) -> LocalSlice:
        """This slice followed by `later` (a slice of the block this one keeps): one
        ``StridedSlice``, as consecutive Slice steps run."""
        return LocalSlice(
            f"{self.step}; {later.step}",
            tuple(b + lb for b, lb in zip(self.begin, later.begin, strict=True)),
            tuple(b + le for b, le in zip(self.begin, later.end, strict=True)),
            self.local,
            self.groups or later.groups,
        )

    def __str__(self) -> str:
        strides = tuple(1 for _ in self.begin)
        per = f" in each strided group (groups {list(self.groups)})" if self.groups else ""
        return (
            f"StridedSlice({self.begin}, {self.end}, {strides}){per} of local "
            f"{list(self.local)} send_bytes 0"
        )


def _local_slice(
    step: Slice, before: TensorLayout, after: TensorLayout, rank: int, shape: Sequence[int]
) -> LocalSlice:
    """`step` on `rank`: the part of its block (under `before`) it keeps (under `after`);
    in a strided dim, the part of each group's piece (the same in every group)."""
    held = [rs[0] for rs in before.local_ranges(rank, shape)]
    kept = [rs[0] for rs in after.local_ranges(rank, shape)]
    return LocalSlice(
        step.describe(before.matrix),
        tuple(k.start - h.start for h, k in zip(held, kept, strict=True)),
        tuple(k.stop - h.start for h, k in zip(held, kept, strict=True)),
        before.local_shape(shape),
        after.groups,
    )


def fmt_slice(layout: TensorLayout, rank: int, shape: Sequence[int]) -> str:
    """The block of a global tensor `rank` holds: ``[0:16, 0:196]`` (a strided dim: its range
    in every group, ``[0:16+32:48+64:80, 0:32]``)."""
    ranges = layout.local_ranges(rank, shape)
    return "[" + ", ".join("+".join(f"{r.start}:{r.stop}" for r in rs) for rs in ranges) + "]"


Found = tuple[Collective, list[int], int] | LocalSlice
"""A collective with this rank's group and the bytes it sends, or a local slice."""


def edge_sends(e: EdgePlan, rank: int) -> list[Found]:
    """This edge's collectives with this rank's group and the bytes it sends in each, and its
    local slices, in the order they run."""
    m = e.src.layout.matrix
    if e.shared:
        return []
    size = int(getattr(torch, e.dtype).itemsize)
    out: list[Found] = []
    n = math.prod(e.src.layout.local_shape(e.shape)) * size
    fused = e.scatter_axes
    if fused:  # (the AllReduce over their axes and the first Slices: one ReduceScatter)
        group = sorted(m.group_along(rank, fused))
        names = tuple(m.names[a] for a in fused)
        c = Collective("ReduceScatter", names, "", "sum", dim=e.cuts[0].dim)
        out.append((c, group, bytes_bound("ReduceScatter", n, len(group))))
        n //= len(group)
    if e.summed:
        if e.weighted:  # (the pair (mean x count, count), in float32 or float64)
            n = 2 * (8 if e.dtype == "float64" else 4)
        group = sorted(m.group_along(rank, e.summed))
        c = Collective("AllReduce", tuple(m.names[a] for a in e.summed), "", e.src.reduce)
        out.append((c, group, bytes_bound("AllReduce", n, len(group))))
    if e.steps:
        start = e.after_scatter if fused else e.src.layout  # (as the executor moves)
        moved = plan_redistribution(start, e.dst.layout, e.shape, size)
        befores = (moved.src, *moved.layouts[:-1]) if moved.steps else ()
        at = 0
        for run in gather_runs(moved.steps, m.shape):
            step, before, after = run[0], befores[at], moved.layouts[at]
            sent = sum(moved.step_bytes[at : at + len(run)])  # (a run: the steps' bytes)
            at += len(run)
            if m.shape[step.axis] == 1:
                continue
            if isinstance(step, Slice):
                cut = _local_slice(step, before, after, rank, e.shape)
                last = out[-1] if out else None
                if isinstance(last, LocalSlice):  # consecutive slices: one StridedSlice
                    out[-1] = last.then(cut)
                else:
                    out.append(cut)
                continue
            group = sorted(m.group_along(rank, run_axes(run)))
            c = Collective(type(step).__name__, tuple(m.names[a] for a in run_axes(run)), "")
            out.append((c, group, sent))
    return out


def node_sends(n: NodePlan, m: DeviceMatrix, rank: int) -> list[Found]:
    """An op's own collectives with this rank's group and the bytes it sends."""
    out: list[Found] = []
    for c in n.comms:
        group = sorted(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
        itemsize = int(getattr(torch, n.dtype(c.output)).itemsize)
        local = c.block or math.prod(n.local_shapes[c.output]) * itemsize
        if c.kind == "ReduceScatter":
            local *= len(group)  # (the unscattered input)
        out.append((c, group, bytes_bound(c.kind, local, len(group))))
    return out
