"""What a sharding rule returns: `OpPlan` (device matrix, layouts, forward communication).

- `Comm`: one forward collective a strategy implies (``AllReduce`` of partial sums over some
  device axes, or ``ReduceScatter`` of them onto one output dim), as plain data.
- `OpPlan`: one primitive call planned on the devices: its device matrix, one `TensorLayout` per
  input and per output (outputs as they are *after* the comms), the comms, and a tag for local
  compute that is not just "run the op on the local shards" (`local`).
- `Rule`: the signature of every sharding rule in `shardwise.ops.rules.RULES`.
- `Strategy`: a normalized strategy (a tuple of int tuples, or of `TensorLayout`s).

Everything here is pure data: no tensors, no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from shardwise.layout import DeviceMatrix, TensorLayout

Strategy: TypeAlias = tuple[tuple[int, ...] | TensorLayout, ...]
"""One entry per input: a tuple of split counts, or a `TensorLayout` (a Layout call)."""

Shape: TypeAlias = tuple[int, ...]

Rule: TypeAlias = Callable[
    [Mapping[str, Any], Strategy | None, Strategy | None, Sequence[Sequence[int]], int, str],
    "OpPlan",
]
"""``rule(op_args, in_strategy, out_strategy, input_shapes, device_num, who) -> OpPlan``.

`op_args` holds ``"op"`` (the primitive's name), its constructor arguments and its non-tensor
call arguments (``axis``, ``perm``, ``shape``); `who` names the primitive in error messages.
"""

CommKind: TypeAlias = Literal["AllReduce", "ReduceScatter"]
ReduceKind: TypeAlias = Literal["sum", "mean", "max"]


@dataclass(frozen=True)
class Comm:
    """A forward collective implied by a strategy.

    Before it, each rank holds a *partial* result: the op computed on its local shards, which
    must still be combined over the ranks that differ along `axes`.

    Attributes:
        kind: ``"AllReduce"`` (every rank gets the combined value) or ``"ReduceScatter"`` (the
            combined value is cut along output dim `dim` over `axes`, first axis outer; each
            rank keeps its block).
        axes: device-matrix axis names the collective runs over (the group: ranks that differ
            only along them, see `DeviceMatrix.group_along`).
        dim: the output dim a ReduceScatter cuts; None for AllReduce.
        op: ``"sum"``, ``"mean"`` (the mean of equal-sized partial means: ReduceMean) or
            ``"max"`` (the maximum of partial maxima: ReduceMax; AllReduce only).
        output: which output of the primitive it applies to.

    Example:
        >>> str(Comm("AllReduce", ("d1",)))
        'AllReduce(sum) over d1'
    """

    kind: CommKind
    axes: tuple[str, ...]
    dim: int | None = None
    op: ReduceKind = "sum"
    output: int = 0

    def axis_indices(self, matrix: DeviceMatrix) -> tuple[int, ...]:
        """The indices of `axes` in `matrix`."""
        return tuple(matrix.axis(a) for a in self.axes)

    def group_size(self, matrix: DeviceMatrix) -> int:
        """How many ranks take part in one instance of the collective."""
        size = 1
        for a in self.axis_indices(matrix):
            size *= matrix.shape[a]
        return size

    def group(self, matrix: DeviceMatrix, rank: int) -> tuple[int, ...]:
        """The ranks `rank` runs this collective with (ordered by coordinate, first axis outer)."""
        return matrix.group_along(rank, self.axis_indices(matrix))

    def __str__(self) -> str:
        where = f", dim {self.dim}" if self.dim is not None else ""
        out = f" on output {self.output}" if self.output else ""
        return f"{self.kind}({self.op}{where}) over {', '.join(self.axes)}{out}"


def _short(layout: TensorLayout) -> str:
    return str(layout).split(" on ")[0]


@dataclass(frozen=True)
class OpPlan:
    """One primitive call laid out on the devices.

    Attributes:
        op: the primitive (``"MatMul"``).
        who: the primitive as errors name it: ``"net.matmul1 (MatMul)"``, or the class name.
        matrix: the primitive's device matrix (tuple strategies: axes ``d0, d1, ...`` plus
            ``repeat``; Layout strategies: the Layout's own axes).
        inputs: the layout each input must have when the op runs.
        outputs: the layout of each output after `comms`.
        input_shapes: global shapes of the inputs.
        output_shapes: global shapes of the outputs.
        comms: the forward collectives, in order (empty: purely local).
        local: ``""`` when each rank simply runs the op on its local shards; otherwise a tag for
            the local computation the runtime must do instead (``"masked_lookup"``: Gather with
            its params split on the gathered axis; ``"random"``: Dropout, whose mask must be the
            rank's slice of one global mask).
        user_set: True when the strategy came from ``shard()``, False for the default.

    Example:
        >>> print(plan)          # plan_primitive(MatMul().shard(((2, 4), (4, 1))), ...)
        MatMul [d0=2, d1=4, d2=1]: (d0, d1), (d1, None) -> (d0, None); AllReduce(sum) over d1
    """

    op: str
    who: str
    matrix: DeviceMatrix
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    comms: tuple[Comm, ...] = ()
    local: str = ""
    user_set: bool = True

    @property
    def device_matrix(self) -> tuple[int, ...]:
        """The device matrix's shape (MindSpore's ``dev_matrix``)."""
        return self.matrix.shape

    def local_input_shapes(self) -> tuple[Shape, ...]:
        """The shape of every rank's block of each input."""
        return tuple(t.local_shape(s) for t, s in zip(self.inputs, self.input_shapes, strict=True))

    def local_output_shapes(self) -> tuple[Shape, ...]:
        """The shape of every rank's block of each output (after `comms`)."""
        return tuple(
            t.local_shape(s) for t, s in zip(self.outputs, self.output_shapes, strict=True)
        )

    def grad_reduce_axes(self, index: int) -> tuple[str, ...]:
        """Axes along which the gradient of input `index` is a partial sum.

        The op's work is split along every axis that splits some input; an input not split along
        such an axis (a replicated weight, a broadcast bias) gets one partial gradient per
        coordinate there, to be summed over those axes in backward.
        """
        used = {a for t in self.inputs for a in t.used_axes() if self.matrix.shape[a] > 1}
        mine = set(self.inputs[index].used_axes())
        return tuple(self.matrix.names[a] for a in sorted(used - mine))

    def __str__(self) -> str:
        axes = ", ".join(
            f"{n}={s}" for n, s in zip(self.matrix.names, self.matrix.shape, strict=True)
        )
        ins = ", ".join(_short(t) for t in self.inputs)
        outs = ", ".join(_short(t) for t in self.outputs)
        name = self.who if self.op in self.who else f"{self.who} ({self.op})"
        comms = "; " + "; ".join(str(c) for c in self.comms) if self.comms else ""
        local = f"; local {self.local}" if self.local else ""
        return f"{name} [{axes}]: {ins} -> {outs}{comms}{local}"
