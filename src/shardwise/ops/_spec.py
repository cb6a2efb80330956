"""The generic planner behind the rules: a `Spec` (each dim's logical axis) -> an `OpPlan`.

A `Spec` is an einsum-like signature of one primitive call: every input and output dim names a
*logical axis* (MatMul ``[M, K] x [K, N] -> [M, N]``: M = 0, K = 1, N = 2), and the logical axes
are the axes of the device matrix of a tuple strategy (MatMul ``((a, b), (b, c))`` -> ``[a, b,
c]``). Dims on one logical axis must be split alike; some may not be split at all (`fixed`);
summed ones (`reduced`) leave partial sums that need an AllReduce when split.

`plan_spec` runs the steps, each a small function:

1. `default_strategy`: no strategy -> data parallel (the batch axis over every device).
2. `_check_entries`: ints or Layouts (never mixed), one entry per input, one value per dim.
3. `_check_ties` / `_check_fixed`: dims on one logical axis split alike; broadcast and `fixed`
   dims (Softmax's axis, LayerNorm's normalized dims, ...) whole.
4. `strategy_layouts` / `check_layout_strategy` (`shardwise.layout`): device matrix, input
   layouts, product and divisibility checks.
5. `_logical_axes` / `_check_disjoint`: each logical axis -> its device axes; no device axis may
   split two logical axes.
6. `_outputs`: output layouts and the AllReduce over the device axes of the `reduced` axes.
7. `_apply_out_strategy`: `out_strategy` may ask for a ReduceScatter onto output dim 0 instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.layout import (
    DeviceMatrix,
    StrategyLayouts,
    TensorLayout,
    check_int_strategy,
    check_layout_strategy,
    strategy_kind,
    strategy_layouts,
)
from shardwise.ops._plan import Comm, OpPlan, ReduceKind, Shape, Strategy

Dims = tuple[int | None, ...]


@dataclass(frozen=True)
class Spec:
    """One primitive call as logical axes (see the module docstring).

    Attributes:
        op: the primitive's name.
        input_names: one name per input, for messages.
        inputs: per input, per dim: its logical axis, or None (a broadcast dim: never split).
            Logical axes must be numbered 0.. in order of first use; they are the device-matrix
            axes of a tuple strategy.
        outputs: per output, per dim: the logical axis it inherits, or None (not split).
        output_shapes: the outputs' global shapes.
        reduced: logical axes summed into output 0 (AllReduce over their device axes).
        fixed: logical axes that may not be split -> why (for the message).
        roles: names of logical axes for messages (``"the contracted dim"``).
        reduce_op: the combination of partial results (``"mean"`` for ReduceMean).
        scatter: whether out_strategy may ask for a ReduceScatter onto output 0's dim 0.
        batch: the logical axis the data-parallel default splits (None: input 0's dim 0;
            -1: none).
        local: `OpPlan.local` (a tag for local compute other than "run the op on the shards").
    """

    op: str
    input_names: tuple[str, ...]
    inputs: tuple[Dims, ...]
    outputs: tuple[Dims, ...]
    output_shapes: tuple[Shape, ...]
    reduced: tuple[int, ...] = ()
    fixed: Mapping[int, str] = field(default_factory=dict)
    roles: Mapping[int, str] = field(default_factory=dict)
    reduce_op: ReduceKind = "sum"
    scatter: bool = False
    local: str = ""
    batch: int | None = None


def fmt_strategy(strategy: Sequence[object]) -> str:
    """A strategy as the user writes it: ``((2, 4), (4, 1))`` or ``(layout('dp', 'None'),)``."""

    def one(entry: object) -> str:
        if isinstance(entry, TensorLayout):
            return layout_call(entry)
        values = list(entry) if isinstance(entry, tuple | list) else [entry]
        return "(" + ", ".join(str(v) for v in values) + ("," if len(values) == 1 else "") + ")"

    inner = ", ".join(one(e) for e in strategy)
    return f"({inner},)" if len(strategy) == 1 else f"({inner})"


def layout_call(layout: TensorLayout) -> str:
    """``layout('mp', ('sp', 'dp'))``: how to write `layout` as a Layout call."""
    names = layout.matrix.names

    def one(axes: tuple[int, ...]) -> str:
        if not axes:
            return "'None'"
        if len(axes) == 1:
            return repr(names[axes[0]])
        return "(" + ", ".join(repr(names[a]) for a in axes) + ")"

    return "layout(" + ", ".join(one(a) for a in layout.dims) + ")"


def default_strategy(spec: Spec, device_num: int) -> tuple[tuple[int, ...], ...]:
    """MindSpore's semi_auto default: the batch axis split over every device, the rest whole.

    The batch axis is ``spec.batch`` (the op's batch: MatMul's M, Gather's indices dim 0), else
    the logical axis of input 0's dim 0; every input dim on it gets `device_num` (as
    `shardwise.layout.data_parallel_strategy` does for dim 0: MatMul ``((8, 1), (1, 1))``). A
    fixed batch axis (Softmax over dim 0) means no split at all.
    """
    batch = spec.batch
    if batch is None and spec.inputs and spec.inputs[0]:
        batch = spec.inputs[0][0]
    if batch in spec.fixed:
        batch = None
    return tuple(
        tuple(device_num if batch is not None and lg == batch else 1 for lg in dims)
        for dims in spec.inputs
    )


def _input(spec: Spec, i: int) -> str:
    return f"input {i} ({spec.input_names[i]})"


def _splits(entry: tuple[int, ...] | TensorLayout, d: int) -> int:
    return entry.split_count(d) if isinstance(entry, TensorLayout) else entry[d]


def _key(entry: tuple[int, ...] | TensorLayout, d: int) -> object:
    """What must agree between dims on one logical axis: the count, or the (non-trivial) axes."""
    if isinstance(entry, TensorLayout):
        return tuple(entry.matrix.names[a] for a in entry.dims[d] if entry.matrix.shape[a] > 1)
    return entry[d]


def _show(entry: tuple[int, ...] | TensorLayout, d: int) -> str:
    if isinstance(entry, TensorLayout):
        axes = [entry.matrix.names[a] for a in entry.dims[d]]
        return f"{entry.split_count(d)} (axes {', '.join(axes) or 'None'})"
    return str(entry[d])


def _with(strategy: Strategy, fixes: Mapping[tuple[int, int], int]) -> str:
    """The int strategy with some (input, dim) values replaced, as a suggestion."""
    out = [
        tuple(fixes.get((i, d), v) for d, v in enumerate(e)) if isinstance(e, tuple) else e
        for i, e in enumerate(strategy)
    ]
    return fmt_strategy(out)


def _count(n: int, noun: str) -> str:
    plural = "entries" if noun == "entry" else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def _check_entries(strategy: Strategy, spec: Spec, shapes: Sequence[Shape], label: str) -> str:
    """Kind, entry count and per-input length; returns ``"ints"`` or ``"layouts"``."""
    kind = strategy_kind(strategy, label)
    names = ", ".join(spec.input_names)
    if len(strategy) != len(spec.inputs):
        raise ValueError(
            f"{label}: strategy {fmt_strategy(strategy)} has {_count(len(strategy), 'entry')} "
            f"but {spec.op} has {_count(len(spec.inputs), 'input')} ({names}); give one entry "
            f"per input"
        )
    ranks = [len(s) for s in shapes]
    if kind == "ints":
        check_int_strategy(strategy, ranks, label, spec.input_names)
        return kind
    matrix = strategy[0].matrix if isinstance(strategy[0], TensorLayout) else None
    for i, (entry, shape) in enumerate(zip(strategy, shapes, strict=True)):
        assert isinstance(entry, TensorLayout)
        if entry.matrix != matrix:
            raise ValueError(
                f"{label}: {_input(spec, i)} is laid out on {entry.matrix} but input 0 on "
                f"{matrix}; all inputs of one primitive need the same Layout"
            )
        if entry.ndim != len(shape):
            raise ValueError(
                f"{label}: {_input(spec, i)} has {len(shape)} dims (shape {list(shape)}) but its "
                f"layout {layout_call(entry)} has {entry.ndim}; give one alias or 'None' per dim"
            )
    return kind


def _check_ties(strategy: Strategy, spec: Spec, shapes: Sequence[Shape], label: str) -> None:
    """Dims on one logical axis split alike; broadcast dims (None) not split."""
    first: dict[int, tuple[int, int]] = {}
    for i, dims in enumerate(spec.inputs):
        entry = strategy[i]
        for d, lg in enumerate(dims):
            if lg is None:
                if _splits(entry, d) > 1:
                    fix = _with(strategy, {(i, d): 1}) if isinstance(entry, tuple) else "'None'"
                    raise ValueError(
                        f"{label}: {_input(spec, i)} dim {d} (size {shapes[i][d]}) is broadcast "
                        f"and cannot be split, but the strategy splits it into "
                        f"{_show(entry, d)}; valid: {fix}"
                    )
                continue
            if lg not in first:
                first[lg] = (i, d)
                continue
            j, e = first[lg]
            if _key(entry, d) != _key(strategy[j], e):
                role = f" ({spec.roles[lg]})" if lg in spec.roles else ""
                other = strategy[j]
                fix = (
                    _with(strategy, {(i, d): other[e]})
                    if isinstance(other, tuple)
                    else f"the same axes as {_input(spec, j)} dim {e}"
                )
                raise ValueError(
                    f"{label}: {_input(spec, j)} dim {e} and {_input(spec, i)} dim {d}{role} must "
                    f"be split alike, but the strategy splits them into {_show(other, e)} and "
                    f"{_show(entry, d)}; valid: {fix}"
                )


def _check_fixed(strategy: Strategy, spec: Spec, label: str) -> None:
    """Dims on a `fixed` logical axis must be whole."""
    bad = {
        (i, d): 1
        for i, dims in enumerate(spec.inputs)
        for d, lg in enumerate(dims)
        if lg in spec.fixed and _splits(strategy[i], d) > 1
    }
    if not bad:
        return
    i, d = next(iter(bad))
    entry = strategy[i]
    lg = spec.inputs[i][d]
    assert lg is not None
    fix = _with(strategy, bad) if isinstance(entry, tuple) else "'None' for that dim"
    raise ValueError(
        f"{label}: {_input(spec, i)} dim {d} {spec.fixed[lg]} and cannot be split, but the "
        f"strategy splits it into {_show(entry, d)}; valid: {fix}"
    )


def _logical_axes(layouts: Sequence[TensorLayout], spec: Spec) -> dict[int, tuple[int, ...]]:
    """Each logical axis -> the device axes splitting it (from its first input dim)."""
    out: dict[int, tuple[int, ...]] = {}
    for layout, dims in zip(layouts, spec.inputs, strict=True):
        for d, lg in enumerate(dims):
            if lg is not None and lg not in out:
                out[lg] = layout.dims[d]
    return out


def _where(spec: Spec, lg: int) -> str:
    for i, dims in enumerate(spec.inputs):
        if lg in dims:
            role = f" ({spec.roles[lg]})" if lg in spec.roles else ""
            return f"{_input(spec, i)} dim {dims.index(lg)}{role}"
    return f"logical axis {lg}"


def _check_disjoint(
    axes: Mapping[int, tuple[int, ...]], matrix: DeviceMatrix, spec: Spec, label: str
) -> None:
    owner: dict[int, int] = {}
    for lg, device_axes in sorted(axes.items()):
        for a in device_axes:
            if matrix.shape[a] > 1 and owner.setdefault(a, lg) != lg:
                raise ValueError(
                    f"{label}: device axis {matrix.names[a]!r} splits both "
                    f"{_where(spec, owner[a])} and {_where(spec, lg)}; one device axis can split "
                    f"only one of the op's dims; use another axis or 'None' for one of them"
                )


def _outputs(
    spec: Spec, matrix: DeviceMatrix, axes: Mapping[int, tuple[int, ...]]
) -> tuple[tuple[TensorLayout, ...], tuple[int, ...]]:
    """Output layouts, and the device axes of the summed logical axes (size > 1)."""
    outs = tuple(
        TensorLayout(matrix, tuple(axes.get(lg, ()) if lg is not None else () for lg in dims))
        for dims in spec.outputs
    )
    red = tuple(a for lg in spec.reduced for a in axes.get(lg, ()) if matrix.shape[a] > 1)
    return outs, red


def _names(matrix: DeviceMatrix, axes: Sequence[int]) -> tuple[str, ...]:
    return tuple(matrix.names[a] for a in axes)


def _matches(entry: tuple[int, ...] | TensorLayout, layout: TensorLayout) -> bool:
    if isinstance(entry, TensorLayout):
        return entry.matrix == layout.matrix and entry.dims == layout.dims
    return entry == tuple(layout.split_count(d) for d in range(layout.ndim))


def _show_out(layout: TensorLayout, kind: str) -> str:
    if kind == "layouts":
        return f"({layout_call(layout)},)"
    return fmt_strategy([tuple(layout.split_count(d) for d in range(layout.ndim))])


def _apply_out_strategy(
    spec: Spec,
    out_strategy: Strategy,
    outs: tuple[TensorLayout, ...],
    red: tuple[int, ...],
    kind: str,
    label: str,
) -> tuple[tuple[TensorLayout, ...], tuple[Comm, ...]]:
    """Match `out_strategy` against the valid output layouts: the AllReduce one, or (for ops
    with `scatter`) output dim 0 further split by the summed axes (a ReduceScatter)."""
    if not spec.scatter:
        raise ValueError(
            f"{label}: the output layout of {spec.op} cannot be configured (it follows from the "
            f"input strategy); drop out_strategy"
        )
    if strategy_kind(out_strategy, label) != kind:
        raise ValueError(f"{label}: in_strategy and out_strategy mix int tuples and Layouts")
    if len(out_strategy) != len(outs):
        raise ValueError(
            f"{label}: out_strategy {fmt_strategy(out_strategy)} has {len(out_strategy)} entries "
            f"but {spec.op} has {len(outs)} output(s)"
        )
    matrix = outs[0].matrix
    names = _names(matrix, red)
    plain = (Comm("AllReduce", names, op=spec.reduce_op),) if red else ()
    candidates = [(outs[0], plain)]
    if red and outs[0].ndim:
        scattered = TensorLayout(matrix, (outs[0].dims[0] + red, *outs[0].dims[1:]))
        candidates.append((scattered, (Comm("ReduceScatter", names, dim=0, op=spec.reduce_op),)))
    for layout, comms in candidates:
        if _matches(out_strategy[0], layout):
            return (layout, *outs[1:]), comms
    valid = " or ".join(_show_out(layout, kind) for layout, _ in candidates)
    raise ValueError(
        f"{label}: out_strategy {fmt_strategy(out_strategy)} does not follow from the input "
        f"strategy; valid: {valid}"
    )


def _resolve(
    strategy: Strategy, spec: Spec, shapes: Sequence[Shape], device_num: int, label: str
) -> tuple[str, StrategyLayouts]:
    """Steps 2-4: the checks, then the device matrix and the input layouts."""
    kind = _check_entries(strategy, spec, shapes, label)
    _check_ties(strategy, spec, shapes, label)
    _check_fixed(strategy, spec, label)
    names = spec.input_names
    if kind == "ints":
        ints = [e for e in strategy if isinstance(e, tuple)]
        res = strategy_layouts(
            ints, device_num, spec.inputs, shapes=shapes, who=label, input_names=names
        )
    else:
        layouts = [e for e in strategy if isinstance(e, TensorLayout)]
        res = check_layout_strategy(
            layouts, device_num, shapes=shapes, who=label, input_names=names
        )
    return kind, res


def plan_spec(
    spec: Spec,
    in_strategy: Strategy | None,
    out_strategy: Strategy | None,
    shapes: Sequence[Shape],
    device_num: int,
    who: str,
) -> OpPlan:
    """Plan one primitive call described by `spec` (see the module docstring for the steps).

    Args:
        spec: the call's logical axes.
        in_strategy: the user's strategy, or None for the data-parallel default.
        out_strategy: optional output strategy (ops with ``spec.scatter`` only).
        shapes: the inputs' global shapes.
        device_num: devices in the job.
        who: the primitive, for messages.

    Returns:
        The `OpPlan`.

    Raises:
        ValueError: any invalid strategy (`LayoutTypeError` for wrong types).

    Example:
        >>> shapes = [(32, 784), (784, 512)]
        >>> spec = matmul_spec({"op": "MatMul"}, shapes, "mm")
        >>> plan_spec(spec, ((2, 4), (4, 1)), None, shapes, 8, "mm").comms
        (Comm(kind='AllReduce', axes=('d1',), dim=None, op='sum', output=0),)
    """
    strategy = in_strategy if in_strategy is not None else default_strategy(spec, device_num)
    label = who
    if in_strategy is None:
        label = f"{who} (default data-parallel strategy {fmt_strategy(strategy)})"
    kind, res = _resolve(strategy, spec, shapes, device_num, label)
    axes = _logical_axes(res.layouts, spec)
    _check_disjoint(axes, res.matrix, spec, label)
    outs, red = _outputs(spec, res.matrix, axes)
    comms: tuple[Comm, ...] = (
        (Comm("AllReduce", _names(res.matrix, red), op=spec.reduce_op),) if red else ()
    )
    if out_strategy is not None:
        outs, comms = _apply_out_strategy(spec, out_strategy, outs, red, kind, label)
    for k, (layout, shape) in enumerate(zip(outs, spec.output_shapes, strict=True)):
        layout.check(shape, f"{label}: output {k}")
    return OpPlan(
        op=spec.op,
        who=who,
        matrix=res.matrix,
        inputs=res.layouts,
        outputs=outs,
        input_shapes=tuple(tuple(s) for s in shapes),
        output_shapes=spec.output_shapes,
        comms=comms,
        local=spec.local,
        user_set=in_strategy is not None,
    )
