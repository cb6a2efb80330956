"""``step_parallel_begin.ir``: every primitive call with its global shapes and strategies.

One line per value: network inputs (global shape, data-parallel layout), parameters (global
shape, planned layout), then each primitive call in execution order::

    %2 = MatMul(%1, %para_fc1_weight) {instance name: matmul1} primitive_attrs: {...}
        {in_strategy: ((2, 4), (4, 1)), in_strategy_from: user, out_strategy: ((2, 1),),
         out_strategy_from: planner, dev_matrix: [d0=2, d1=4, d2=1], forward_comms: ...}
        {in_layouts: (...), out_layouts: (...)} : ([32, 784], [784, 512]) -> ([32, 512])

(printed on one line). ``*_from: user`` means set with ``.shard()``; ``planner`` means the
planner chose it (the data-parallel default, or the output layout a strategy implies). Layouts
are on the global device matrix (axes ``g0, g1, ...``). Level 3 adds, under each call, every
rank's block of each input and output (the slice table).
"""

from __future__ import annotations

from shardwise.parallel._plan import CallPlan, NetworkPlan
from shardwise.report._dataflow import Dataflow, check_flow
from shardwise.report._format import (
    check_level,
    declarations,
    fmt_attrs,
    fmt_layouts,
    fmt_shapes,
    fmt_slice,
    header,
    result_names,
    source_name,
    strategies,
)


def _dev_matrix(cp: CallPlan) -> str:
    m = cp.plan.matrix
    return "[" + ", ".join(f"{n}={s}" for n, s in zip(m.names, m.shape, strict=True)) + "]"


def _call_line(
    i: int, plan: NetworkPlan, flow: Dataflow, results: dict[tuple[int, int], str]
) -> str:
    cp = plan.calls[i]
    module = cp.call.module
    operands = ", ".join(source_name(s, results) for s in flow.calls[i])
    prim = {**module.init_args(), **cp.call.call_args}
    strat: dict[str, object] = {**strategies(cp), "dev_matrix": _dev_matrix(cp)}
    if cp.plan.comms:
        strat["forward_comms"] = "; ".join(str(c) for c in cp.plan.comms)
    layouts = {
        "in_layouts": fmt_layouts(cp.inputs),
        "out_layouts": fmt_layouts(cp.outputs),
    }
    name = f"%{i + 1}"
    parts = [f"{name} = {module.name}({operands})", f"{{instance name: {module.module_path}}}"]
    if prim:
        parts.append(f"primitive_attrs: {fmt_attrs(prim)}")
    parts += [fmt_attrs(strat), fmt_attrs(layouts)]
    shapes = f": {fmt_shapes(cp.call.input_shapes)} -> {fmt_shapes(cp.plan.output_shapes)}"
    return " ".join([*parts, shapes])


def _slice_table(cp: CallPlan, plan: NetworkPlan) -> list[str]:
    lines = []
    for rank in plan.matrix.rank_list:
        ins = ", ".join(
            fmt_slice(t, rank, s) for t, s in zip(cp.inputs, cp.call.input_shapes, strict=True)
        )
        outs = ", ".join(
            fmt_slice(t, rank, s) for t, s in zip(cp.outputs, cp.plan.output_shapes, strict=True)
        )
        lines.append(f"#   rank {rank}: ({ins}) -> ({outs})")
    return lines


def format_step_parallel_begin(plan: NetworkPlan, flow: Dataflow, rank: int, level: int = 1) -> str:
    """The text of ``rank_<rank>/step_parallel_begin.ir`` (pure).

    Args:
        plan: the network's plan (`shardwise.parallel.plan_network`).
        flow: where each call's inputs come from (`trace_sources`).
        rank: the rank the file is for (named in the header; the content is the same on
            every rank, as in MindSpore).
        level: the ``save_graphs`` level (1, 2 or 3; 3 adds the slice table).

    Raises:
        ValueError: a bad level or rank, or `flow` not matching `plan`.
    """
    check_level(level, rank, plan)
    check_flow(plan, flow)
    results = result_names(plan, {i: f"%{i + 1}" for i in range(len(plan.calls))})
    lines = [
        *header("step_parallel_begin", plan, rank, level),
        "",
        *declarations(plan, flow, local=False),
        "",
    ]
    for i, cp in enumerate(plan.calls):
        lines.append(_call_line(i, plan, flow, results))
        if level >= 3:
            lines.append("#   every rank's block, global index ranges (inputs) -> (outputs):")
            lines += _slice_table(cp, plan)
    outs = ", ".join(source_name(s, results) for s in flow.outputs)
    lines.append(f"return({outs})")
    return "\n".join(lines) + "\n"
