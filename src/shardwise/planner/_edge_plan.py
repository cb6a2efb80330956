"""`EdgePlan`: one value moved between its producer and a consumer, as a `ParallelPlan` lists it.

The AllReduce of the producer's partial sums, then the redistribution steps (Slice, AllGather,
AlltoAll), then the parts a partial destination keeps; with `EdgePlan.scatter` the AllReduce
over the axes of the first Slices of one dim and those Slices run as one ReduceScatter
(`_scatter`).
`EdgePlan.collectives` lists what it sends; ``str()`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.layout import TensorLayout
from shardwise.planner._placed import Collective, Placed, Shape, _axes_str
from shardwise.planner._scatter import scatter_cuts
from shardwise.redistribution import (
    Slice,
    Step,
    apply_step,
    describe_run,
    gather_runs,
    plan_redistribution,
    run_axes,
)


@dataclass(frozen=True)
class EdgePlan:
    """A value moved between its producer and a consumer.

    Attributes:
        consumer: the consuming node's index (-1: the value is returned).
        slot: which of its tensor inputs (or returned values).
        value: the value (``"%3"``, ``"param:w"``, ``"input:args[0]"``).
        shape: its global shape.
        src / dst: the producer's placement and the one wanted.
        steps: after the AllReduce of `src`'s partial axes not partial in `dst`, the
            redistribution steps (then `kept`, for axes partial in `dst` only).
        shared: the same value was already moved to `dst` for an earlier consumer of this
            forward: that result is reused (no collective; its backward adjoint runs once).
        dtype: the value's dtype (``"float32"``).
        equal_grad: axes of `reduced` whose adjoint is local (the gradient is the same on
            their ranks: `_backward`).
        seeded: the adjoint of the AllReduce of `reduced` is local when backward starts with
            no gradient (a seed of ones): every consumer of the value runs alike on every
            rank (`_seeded`).
        deferred: (a seeded weighted mean loss's AllReduce) a seeded backward divides by this
            rank's count times the group size instead of waiting for the summed count, and the
            gradient buckets correct each rank's gradients by estimate / sum
            (`_seeded.plan_deferred`).
        written_back: after its consumer ran, which changed its moved input `slot` (this
            rank's block of a whole buffer: a BatchNorm's running statistics of split
            features) in place, that block is moved from `src` back to the whole `dst` and
            copied into the value.
        weighted: (a mean loss's AllReduce) the ranks' means are weighted by the targets
            each counted: the AllReduce carries the pair (mean x count, count) in float32
            (float64 for a float64 loss) (`_losses`).
        scatter: the AllReduce over the axes of the first steps, `Slice`s of one dim (the
            rows of a row-parallel layer's output cut for the next data-parallel op: `cuts`),
            and those Slices run as one ReduceScatter over those axes along the Slices' dim,
            at half the bytes (its adjoint an AllGather instead of an AllReduce); the other
            reduced axes are all-reduced on the cut block (`_scatter`).
    """

    consumer: int
    slot: int
    value: str
    shape: Shape
    src: Placed
    dst: Placed
    steps: tuple[Step, ...] = ()
    shared: bool = False
    dtype: str = "float32"
    equal_grad: tuple[int, ...] = ()
    seeded: bool = False
    deferred: bool = False
    written_back: bool = False
    weighted: bool = False
    scatter: bool = False

    @property
    def reduced(self) -> tuple[int, ...]:
        """Axes whose partial values are all-reduced on this edge."""
        return tuple(a for a in self.src.partial if a not in self.dst.partial)

    @property
    def cuts(self) -> tuple[Slice, ...]:
        """The Slices that run inside the edge's ReduceScatter (`scatter`; none: ``()``): its
        first steps, of one dim, over reduced axes (`_scatter.scatter_cuts`)."""
        if not self.scatter:
            return ()
        return scatter_cuts(self.steps, self.reduced, self.src.layout.matrix)

    @property
    def scatter_axes(self) -> tuple[int, ...]:
        """The axes of a `scatter` edge's ReduceScatter, in the order its `cuts` split the dim
        (first outer: its group's rank order); ``()`` without one."""
        return tuple(c.axis for c in self.cuts)

    @property
    def after_scatter(self) -> TensorLayout:
        """The layout after a `scatter` edge's ReduceScatter (its `cuts` applied)."""
        cuts = self.cuts
        assert cuts, "an edge with a scatter"
        layout = self.src.layout
        for cut in cuts:
            layout = apply_step(layout, cut)
        return layout

    @property
    def summed(self) -> tuple[int, ...]:
        """The reduced axes its AllReduce runs over (all, less a `scatter`'s axes)."""
        scattered = self.scatter_axes
        return tuple(a for a in self.reduced if a not in scattered)

    @property
    def kept(self) -> tuple[int, ...]:
        """Axes over which a whole value becomes a partial sum: kept on the ranks at
        coordinate 0 of these axes, zero on the others (no collective). A whole value is
        already a partial average (or maximum) as it stands: every rank keeps it."""
        if self.dst.reduce != "sum":
            return ()
        return tuple(a for a in self.dst.partial if a not in self.src.partial)

    def collectives(self, where: str) -> list[Collective]:
        """The collectives of this edge (slices are local and not listed)."""
        m = self.src.layout.matrix
        out: list[Collective] = []
        if self.shared:
            return out
        cuts = self.cuts
        if cuts:
            names = tuple(m.names[c.axis] for c in cuts)
            out.append(Collective("ReduceScatter", names, where, "sum", dim=cuts[0].dim))
        if self.summed:
            names = tuple(m.names[a] for a in self.summed)
            out.append(Collective("AllReduce", names, where, self.src.reduce))
        for run in gather_runs(self.steps_after_scatter if cuts else self.steps, m.shape):
            step = run[0]  # (AllGathers of one dim gathered together: one over all their axes)
            if isinstance(step, Slice) or m.shape[step.axis] == 1:
                continue
            names = tuple(m.names[a] for a in run_axes(run))
            out.append(Collective(type(step).__name__, names, where))
        return out

    @property
    def steps_after_scatter(self) -> tuple[Step, ...]:
        """A `scatter` edge's steps after its ReduceScatter, as the executor runs them (planned
        from `after_scatter`)."""
        size = int(getattr(torch, self.dtype).itemsize)
        moved = plan_redistribution(self.after_scatter, self.dst.layout, self.shape, size)
        return tuple(moved.steps)

    def __str__(self) -> str:
        if self.shared:
            return f"{self.value} {self.src} -> {self.dst}: reused (moved for an earlier op)"
        parts = []
        m = self.src.layout.matrix
        cuts = self.cuts
        if cuts:
            over = _axes_str(m, self.scatter_axes)
            parts.append(f"ReduceScatter(sum) over {over} on dim {cuts[0].dim}")
        if self.summed:
            parts.append(f"AllReduce({self.src.reduce}) over {_axes_str(m, self.summed)}")
        runs = gather_runs(self.steps_after_scatter if cuts else self.steps, m.shape)
        parts += [describe_run(r, m) for r in runs]
        m = self.src.layout.matrix
        if self.kept:
            parts.append(f"kept on the first rank of {_axes_str(m, self.kept)}")
        if self.equal_grad:
            parts.append(f"backward local on {_axes_str(m, self.equal_grad)}")
        if self.seeded:
            parts.append("backward local from loss.backward()")
        if self.weighted:
            parts.append("weighted by the targets each rank counted (the pair in float32)")
        if self.deferred:
            parts.append("backward does not wait for the count")
        if self.written_back:
            return f"{self.value} {self.src} -> {self.dst} after the op: " + "; ".join(parts)
        return f"{self.value} {self.src} -> {self.dst}: " + ("; ".join(parts) or "no step")
