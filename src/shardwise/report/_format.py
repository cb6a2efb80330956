"""Text pieces shared by both reports: shapes, layouts, strategies, value names, headers.

Values are named as in MindSpore's IR: ``%input0`` (network input 0), ``%para_<name>`` (a
parameter), ``%<n>`` (an op's result, numbered in order). A strategy is printed as the user
wrote it (int tuples or Layout calls, `shardwise.ops._spec.fmt_strategy`); a strategy the
planner chose is printed in the same kind, derived from the plan's layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.layout import TensorLayout
from shardwise.ops._spec import fmt_strategy
from shardwise.parallel._plan import CallPlan, NetworkPlan
from shardwise.report._dataflow import Dataflow, Source, source_layout

Shape = tuple[int, ...]
LEVELS = (1, 2, 3)


def fmt_shape(shape: Sequence[int]) -> str:
    """``[32, 784]``."""
    return "[" + ", ".join(str(s) for s in shape) + "]"


def fmt_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """``([32, 784], [784, 512])``."""
    return "(" + ", ".join(fmt_shape(s) for s in shapes) + ")"


def fmt_layout(layout: TensorLayout) -> str:
    """A layout's tensor map on its matrix: ``((g1, g2), None)``."""
    return str(layout).split(" on ")[0]


def fmt_layouts(layouts: Sequence[TensorLayout]) -> str:
    """``((g0, (g1, g2)), ((g1, g2), None))``; one layout: ``((g0, None),)``."""
    inner = ", ".join(fmt_layout(t) for t in layouts)
    return f"({inner},)" if len(layouts) == 1 else f"({inner})"


def fmt_slice(layout: TensorLayout, rank: int, shape: Sequence[int]) -> str:
    """The block of a global tensor `rank` holds: ``[0:16, 0:196]``."""
    parts = layout.local_slice(rank, shape)
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in parts) + "]"


def fmt_value(v: Any) -> str:
    """Attribute values: lowercase bools, like MindSpore's IR."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def fmt_attrs(attrs: Mapping[str, Any]) -> str:
    """``{a: 1, b: x}``."""
    return "{" + ", ".join(f"{k}: {fmt_value(v)}" for k, v in attrs.items()) + "}"


def _split_counts(layouts: Sequence[TensorLayout]) -> str:
    return fmt_strategy([tuple(t.split_count(d) for d in range(t.ndim)) for t in layouts])


def strategies(cp: CallPlan) -> dict[str, str]:
    """in_strategy / out_strategy as the user wrote them, or as the planner chose them, with
    where each came from (``user`` / ``planner``)."""
    module = cp.call.module
    as_layouts = module.in_strategy is not None and any(
        isinstance(e, TensorLayout) for e in module.in_strategy
    )

    def chosen(layouts: Sequence[TensorLayout]) -> str:
        return fmt_strategy(list(layouts)) if as_layouts else _split_counts(layouts)

    ins = module.in_strategy
    outs = module.out_strategy
    return {
        "in_strategy": fmt_strategy(ins) if ins is not None else chosen(cp.plan.inputs),
        "in_strategy_from": "user" if cp.plan.user_set and ins is not None else "planner",
        "out_strategy": fmt_strategy(outs) if outs is not None else chosen(cp.plan.outputs),
        "out_strategy_from": "user" if outs is not None else "planner",
    }


def input_shapes(plan: NetworkPlan, flow: Dataflow) -> dict[int, Shape]:
    """Network input index -> global shape, read from the calls that consume it."""
    out: dict[int, Shape] = {}
    for cp, srcs in zip(plan.calls, flow.calls, strict=True):
        for src, shape in zip(srcs, cp.call.input_shapes, strict=True):
            if src.kind == "input":
                out.setdefault(src.index, shape)
    return out


def result_names(plan: NetworkPlan, names: Mapping[int, str]) -> dict[tuple[int, int], str]:
    """(call, output) -> value name, given each call's result name (``%3`` -> ``%3[1]`` for the
    second output of a multi-output call)."""
    out: dict[tuple[int, int], str] = {}
    for i, cp in enumerate(plan.calls):
        n = len(cp.outputs)
        for k in range(n):
            out[(i, k)] = names[i] if n == 1 else f"{names[i]}[{k}]"
    return out


def source_name(src: Source, results: Mapping[tuple[int, int], str]) -> str:
    """The value name of a `Source` (``%?`` for an unknown producer)."""
    if src.kind == "input":
        return f"%input{src.index}"
    if src.kind == "param":
        return f"%para_{src.name}"
    if src.kind == "call":
        return results.get((src.index, src.output), "%?")
    return "%torch_op" if src.kind == "torch" else "%const"


def declarations(plan: NetworkPlan, flow: Dataflow, local: bool) -> list[str]:
    """One line per network input and planned parameter: shape (global, or this rank's block
    when `local`) and layout on the global matrix."""
    lines = []
    for i, shape in sorted(input_shapes(plan, flow).items()):
        layout = source_layout(plan, flow, Source("input", index=i), len(shape))
        assert layout is not None
        state = flow.input_state(i)
        how = {"dp": "data_parallel", "rep": "full_batch"}.get(str(state), "layout")
        attrs = fmt_attrs({"layout": fmt_layout(layout), "arrives": how})
        lines.append(
            f"%input{i} : {fmt_shape(layout.local_shape(shape) if local else shape)} {attrs}"
        )
    for name, (layout, shape) in plan.params.items():
        attrs = fmt_attrs({"layout": fmt_layout(layout)})
        lines.append(
            f"%para_{name} : {fmt_shape(layout.local_shape(shape) if local else shape)} {attrs}"
        )
    return lines


def header(kind: str, plan: NetworkPlan, rank: int, level: int) -> list[str]:
    """The first lines of a report."""
    coord = plan.matrix.coord(rank)
    return [
        f"# shardwise IR: {kind}, rank {rank} of {plan.matrix.size}, save_graphs={level}",
        f"# device matrix: {plan.matrix}; rank {rank} at coordinate {coord}",
        f"# primitive calls: {len(plan.calls)}",
    ]


def check_level(level: int, rank: int, plan: NetworkPlan) -> None:
    """Raise ValueError for a level outside 1..3 or a rank outside the plan's matrix."""
    if level not in LEVELS:
        raise ValueError(f"report: level {level!r} must be 1, 2 or 3")
    if rank not in plan.matrix.rank_list:
        raise ValueError(f"report: rank {rank} is not in {plan.matrix}")
