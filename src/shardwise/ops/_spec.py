"""The generic planner behind the rules: a `Spec` (each dim's logical axis) -> an `OpPlan`.

A `Spec` is an einsum-like signature of one primitive call: every input and output dim names a
*logical axis* (MatMul ``[M, K] x [K, N] -> [M, N]``: M = 0, K = 1, N = 2), and the logical axes
are the axes of the device matrix of a tuple strategy (MatMul ``((a, b), (b, c))`` -> ``[a, b,
c]``). Dims on one logical axis must be split alike; some may not be split at all (`fixed`);
summed ones (`reduced`) leave partial sums that need an AllReduce when split.

`plan_spec` runs the steps, each a small function (the checks of steps 2, 3 and 5, and how
strategies are written in their messages, are in `shardwise.ops._spec_checks`):

1. `default_strategy`: no strategy -> data parallel (the batch axis over every device).
2. `check_entries`: ints or Layouts (never mixed), one entry per input, one value per dim.
3. `check_ties` / `check_fixed`: dims on one logical axis split alike; broadcast and `fixed`
   dims (Softmax's axis, LayerNorm's normalized dims, ...) whole. Their messages list only
   fixes that plan: each candidate is planned in turn (`plans`, the op's rule), on the error
   path only (`shardwise.ops._spec_fixes`).
4. `strategy_layouts` / `check_layout_strategy` (`shardwise.layout`): device matrix, input
   layouts, product and divisibility checks (`_resolve` runs steps 2-4).
5. `_logical_axes` / `check_disjoint`: each logical axis -> its device axes; no device axis may
   split two logical axes.
6. `_outputs`: output layouts and the AllReduce over the device axes of the `reduced` axes.
7. `_apply_out_strategy`: `out_strategy` may ask for a ReduceScatter onto output dim 0 instead,
   where that split divides the dim (messages list only the values whose splits divide).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.layout import (
    DeviceMatrix,
    StrategyLayouts,
    TensorLayout,
    check_layout_strategy,
    strategy_kind,
    strategy_layouts,
)
from shardwise.ops._plan import Comm, OpPlan, ReduceKind, Shape, Strategy
from shardwise.ops._spec_checks import (
    check_disjoint,
    check_entries,
    check_fixed,
    check_ties,
    fmt_strategy,
    layout_call,
)
from shardwise.ops._spec_fixes import Plans

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


def _logical_axes(layouts: Sequence[TensorLayout], spec: Spec) -> dict[int, tuple[int, ...]]:
    """Each logical axis -> the device axes splitting it (from its first input dim)."""
    out: dict[int, tuple[int, ...]] = {}
    for layout, dims in zip(layouts, spec.inputs, strict=True):
        for d, lg in enumerate(dims):
            if lg is not None and lg not in out:
                out[lg] = layout.dims[d]
    return out


def _outputs(
    spec: Spec, matrix: DeviceMatrix, axes: Mapping[int, tuple[int, ...]]
) -> tuple[tuple[TensorLayout, ...], tuple[int, ...]]:
    """Output layouts, and the device axes of the summed logical axes (size > 1)."""
    outs = tuple(TensorLayout(matrix, _output_dims(dims, matrix, axes)) for dims in spec.outputs)
    red = tuple(a for lg in spec.reduced for a in axes.get(lg, ()) if matrix.shape[a] > 1)
    return outs, red


def _output_dims(
    dims: Sequence[int | None], matrix: DeviceMatrix, axes: Mapping[int, tuple[int, ...]]
) -> tuple[tuple[int, ...], ...]:
    """One output's device axes per dim; an axis of size 1 that two of its dims would take
    (``layout("dp", "mp")`` times ``layout("mp", "dp")`` with dp of size 1: it splits nothing,
    so the inputs may use it twice) is kept on the first only."""
    seen: set[int] = set()
    out = []
    for lg in dims:
        kept = []
        for a in axes.get(lg, ()) if lg is not None else ():
            if a in seen and matrix.shape[a] == 1:
                continue
            seen.add(a)
            kept.append(a)
        out.append(tuple(kept))
    return tuple(out)


def _names(matrix: DeviceMatrix, axes: Sequence[int]) -> tuple[str, ...]:
    return tuple(matrix.names[a] for a in axes)


def _matches(entry: tuple[int, ...] | TensorLayout, layout: TensorLayout) -> bool:
    """Whether the user's `entry` asks for `layout`: the same split counts, or the same device
    axes per dim in the same order, axes of size 1 (which split nothing) aside."""
    if isinstance(entry, TensorLayout):
        return entry.matrix == layout.matrix and _split_axes(entry) == _split_axes(layout)
    return entry == tuple(layout.split_count(d) for d in range(layout.ndim))


def _split_axes(layout: TensorLayout) -> tuple[tuple[int, ...], ...]:
    """Per dim, the device axes of size > 1 that split it, outer first."""
    shape = layout.matrix.shape
    return tuple(tuple(a for a in axes if shape[a] > 1) for axes in layout.dims)


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
    shape = spec.output_shapes[0]
    for layout, comms in candidates:
        if _matches(out_strategy[0], layout) and _divides(layout, shape):
            return (layout, *outs[1:]), comms
    layouts = [layout for layout, _ in candidates]
    raise ValueError(f"{label}: {_out_strategy_error(out_strategy, layouts, shape, kind)}")


def _divides(layout: TensorLayout, shape: Shape) -> bool:
    """Whether `layout` can hold a tensor of global `shape` (every split divides its dim)."""
    try:
        layout.check(shape)
    except ValueError:
        return False
    return True


def _out_strategy_error(
    out_strategy: Strategy, candidates: Sequence[TensorLayout], shape: Shape, kind: str
) -> str:
    """Why `out_strategy` is refused (the message after the label): the valid values are the
    candidates whose splits divide output 0's `shape`; one that does not is named with why."""
    asked = fmt_strategy(out_strategy)
    fit = [c for c in candidates if _divides(c, shape)]
    unfit = [c for c in candidates if not _divides(c, shape)]
    why = [
        (c, f"dim {d} of size {shape[d]} into {c.split_count(d)} parts")
        for c in unfit
        for d in [d for d in range(c.ndim) if shape[d] % c.split_count(d)][:1]
    ]
    asked_unfit = [reason for c, reason in why if _matches(out_strategy[0], c)]
    if asked_unfit:
        head = (
            f"out_strategy {asked} cannot hold output 0 (shape {list(shape)}): it would split "
            f"{asked_unfit[0]}"
        )
        others = [(c, reason) for c, reason in why if not _matches(out_strategy[0], c)]
    else:
        head = f"out_strategy {asked} does not follow from the input strategy"
        others = why
    notes = "; ".join(
        f"{_show_out(c, kind)}: it would split output 0 {reason}" for c, reason in others
    )
    if not fit:
        return (
            f"{head}; no output layout that follows from the input strategy divides output 0 "
            f"(shape {list(shape)}){': ' + notes if notes else ''}; drop out_strategy and choose "
            f"an input strategy whose splits divide the output"
        )
    valid = " or ".join(_show_out(c, kind) for c in fit)
    return f"{head}; valid: {valid}" + (f" (not {notes})" if notes else "")


def _resolve(
    strategy: Strategy,
    spec: Spec,
    shapes: Sequence[Shape],
    device_num: int,
    label: str,
    plans: Plans,
) -> tuple[str, StrategyLayouts]:
    """Steps 2-4: the checks (their messages list the fixes that `plans` accepts), then the
    device matrix and the input layouts."""
    kind = check_entries(strategy, spec, shapes, label)
    check_ties(strategy, spec, shapes, label, device_num, plans)
    check_fixed(strategy, spec, label, shapes, device_num, plans)
    names = spec.input_names
    if kind == "ints":
        ints = [e for e in strategy if isinstance(e, tuple)]
        res = strategy_layouts(
            ints, device_num, spec.inputs, shapes=shapes, who=label, input_names=names
        )
    else:
        layouts = [e for e in strategy if isinstance(e, TensorLayout)]
        for i, layout in enumerate(layouts):
            if layout.strided:
                name = names[i] if names and i < len(names) else f"input {i}"
                raise ValueError(
                    f"{label}: input {i} ({name}) is laid out strided ({layout}); a "
                    f"primitive's strategy takes plain layouts only (strided layouts are for "
                    f"torch ops: sw.shard's op form on nn.Linear, sw.reshard, parameter_plan)"
                )
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
    plans: Plans | None = None,
) -> OpPlan:
    """Plan one primitive call described by `spec` (see the module docstring for the steps).

    Args:
        spec: the call's logical axes.
        in_strategy: the user's strategy, or None for the data-parallel default.
        out_strategy: optional output strategy (ops with ``spec.scatter`` only).
        shapes: the inputs' global shapes.
        device_num: devices in the job.
        who: the primitive, for messages.
        plans: the op's rule on one strategy (`shardwise.ops._spec_fixes.Plans`), which a
            message's suggested fixes must pass; None: this plan without out_strategy (a rule
            adding checks of its own passes itself).

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
    if plans is None:

        def plans(candidate: Strategy) -> OpPlan:
            return plan_spec(spec, candidate, None, shapes, device_num, who)

    kind, res = _resolve(strategy, spec, shapes, device_num, label, plans)
    axes = _logical_axes(res.layouts, spec)
    check_disjoint(axes, res.matrix, spec, label)
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
