"""The small parts of a `ParallelPlan`: placements, collectives, parameter storage, buckets.

- `Placed`: how a value is spread over the devices: a `TensorLayout` (which axes split which
  dim, ``strided(g1, 3)`` for a strided one) plus the axes on which each rank holds a partial
  sum (``Partial`` in DTensor's terms); `replicated`: whole on every rank.
- `Collective`: one collective the plan runs (kind, axes, where).
- `ParamPlan`: the layout a parameter is stored in; `BucketPlan`: a fused collective over
  gradients or weights.
- `Root`: a value a train step's backward starts from, with its placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.layout import DeviceMatrix, TensorLayout

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Placed:
    """A value's distribution.

    Attributes:
        layout: which axes split which dim (on the plan's matrix).
        partial: axes over which the ranks hold partial values still to be reduced.
        reduce: ``"sum"`` or ``"avg"``: how the partial values combine.
    """

    layout: TensorLayout
    partial: tuple[int, ...] = ()
    reduce: str = "sum"

    def __str__(self) -> str:
        m, layout = self.layout.matrix, self.layout
        dims = ", ".join(
            f"strided({_axes_str(m, a)}, {layout.groups_of(d)})"
            if layout.groups_of(d) > 1
            else _axes_str(m, a)
            for d, a in enumerate(layout.dims)
        )
        text = f"({dims})"
        if self.partial:
            text += f" partial-{self.reduce}[{_axes_str(self.layout.matrix, self.partial)}]"
        return text

    def local_shape(self, shape: Sequence[int]) -> Shape:
        """This layout's block shape of a tensor of global `shape`."""
        return tuple(self.layout.local_shape(shape))

    def spread(self) -> int:
        """Over how many ranks one copy of the value is spread: the product of the sizes of
        the axes that split it or hold it partial (1: each rank holds all of it)."""
        sizes = self.layout.matrix.shape
        n = 1
        for a in set(self.layout.used_axes()) | set(self.partial):
            n *= sizes[a]
        return n


def _axes_str(matrix: DeviceMatrix, axes: Sequence[int]) -> str:
    names = [matrix.names[a] for a in axes]
    if not names:
        return "None"
    return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"


def replicated(matrix: DeviceMatrix, ndim: int) -> Placed:
    """Whole on every rank."""
    return Placed(TensorLayout(matrix, ((),) * ndim))


@dataclass(frozen=True)
class Collective:
    """One collective the plan runs: its kind, the axes it runs over, and where (for an op's
    own collective, also which of its outputs it combines and, for a ReduceScatter, the dim it
    cuts).

    Example:
        >>> str(Collective("AllReduce", ("g0",), "cross_entropy -> return", "sum"))
        'AllReduce(sum) over g0 at cross_entropy -> return'
    """

    kind: str
    axes: tuple[str, ...]
    where: str
    detail: str = ""
    output: int = 0
    dim: int | None = None
    equal_grad: tuple[str, ...] = ()  # (AllReduce) axes whose adjoint is local (`_backward`)
    block: int = 0  # >0: run inside the op (a batch norm's statistics), from a block of so
    # many bytes; the executor does not run it on the op's output

    def __str__(self) -> str:
        detail = f"({self.detail})" if self.detail else ""
        local = f"; backward local on {', '.join(self.equal_grad)}" if self.equal_grad else ""
        return f"{self.kind}{detail} over {', '.join(self.axes)} at {self.where}{local}"


@dataclass(frozen=True)
class ParamPlan:
    """The layout a parameter is stored in (`shape`: global) and its dtype."""

    layout: TensorLayout
    shape: Shape
    dtype: str = "float32"

    def __str__(self) -> str:
        return f"{Placed(self.layout)} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class BucketPlan:
    """A fused collective over gradients or weights (`optim.Bucket` on the plan's matrix).

    Attributes:
        kind: ``"allreduce"`` (the gradients all-reduced over `axes`) or ``"shard"`` (optimizer
            parallel: weights all-gathered and gradients reduce-scattered over a shard group
            of `shard` ranks along `axes`).
        axes: the data-parallel axes (names on the plan's matrix; empty: no collective, the
            gradients are only scaled).
        params: the parameters, in bucket order.
        shard: the shard group's size (1 for ``"allreduce"``).
        fusion: the ``comm_fusion`` id that formed it (-1: formed by size or index).
        level: (``"shard"``) the hsdp ``optimizer_level`` its weights are gathered at (level
            3 gathers them again in backward); empty for ``"allreduce"``.
    """

    kind: str
    axes: tuple[str, ...]
    params: tuple[str, ...]
    shard: int = 1
    fusion: int = -1
    level: str = ""

    def __str__(self) -> str:
        how = "AllReduce" if self.kind == "allreduce" else f"shard {self.shard}-way"
        how += f" {self.level}" if self.level else ""
        over = ", ".join(self.axes) or "no axis (scaled only)"
        return f"{how} over {over} fusion={self.fusion}: {', '.join(self.params)}"


@dataclass(frozen=True)
class Root:
    """A value a train step's backward starts from (``loss.backward()``'s loss).

    Attributes:
        value: the value (``"%41"``, ``"%7.1"``; as `EdgePlan.value` names them).
        placed: its placement when backward starts.
    """

    value: str
    placed: Placed

    def __str__(self) -> str:
        return f"{self.value} {self.placed} (seed x{self.placed.spread()})"
