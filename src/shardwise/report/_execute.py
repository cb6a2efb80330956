"""``execute.ir``: what one rank runs, with local shapes and every inserted communication op.

For each primitive call, in order: the redistribution steps of each non-parameter input
(``StridedSlice`` for a local `Slice`, ``AllGather``, ``AlltoAll``; from the layout its producer
left, data parallel for a network input), the primitive on this rank's blocks (its output is a
partial result when comms follow), then the plan's forward comms (``AllReduce`` /
``ReduceScatter``). The wrapper's final redistribution of each network output back to data
parallel closes the file. Every communication op carries its kind, its axes, ``group`` (the
global ranks this rank runs it with, sorted: the process group's members), ``group_size`` and
``fusion: 0``.

Redistribution axes are axes of the global matrix (``g0, g1, ...``); a primitive's comm axes
are axes of its own matrix (``d0, d1, ...``, or its Layout's aliases). Comms over a single rank
are not inserted (as at run time). Level 2 adds ``send_bytes`` (bytes this rank sends, by the
collective's bound, float32 assumed) and this rank's block of each primitive's tensors; level 3
adds the layout after every redistribution step.
"""

from __future__ import annotations

import math

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix
from shardwise.ops import Comm
from shardwise.parallel._plan import CallPlan, NetworkPlan
from shardwise.redistribution import AllGather, RedistributionPlan, Slice, Step
from shardwise.report._dataflow import Dataflow, input_redistributions, output_redistributions
from shardwise.report._format import (
    check_level,
    declarations,
    fmt_attrs,
    fmt_layout,
    fmt_shapes,
    fmt_slice,
    header,
    source_name,
    strategies,
)

Shape = tuple[int, ...]
ITEMSIZE = 4
_UNTRACKED = {
    "torch": "from an unannotated torch op, taken as data parallel",
    "const": "a constant (not an activation): the runtime refuses it as a primitive input",
}


class _Text:
    """The lines being written, the next value number and the bytes this rank sends."""

    def __init__(self, rank: int, level: int) -> None:
        self.rank, self.level = rank, level
        self.lines: list[str] = []
        self.count = 0
        self.sent = 0

    def op(self, kind: str, operands: str, attrs: dict[str, object], ins: str, outs: str) -> str:
        self.count += 1
        name = f"%{self.count}"
        self.lines.append(f"{name} = {kind}({operands}) {fmt_attrs(attrs)} : {ins} -> {outs}")
        return name


def _step_attrs(step: Step, m: DeviceMatrix, t: _Text) -> dict[str, object]:
    attrs: dict[str, object]
    if isinstance(step, Slice):
        attrs = {"dim": step.dim, "axis": m.names[step.axis], "parts": m.shape[step.axis]}
        return attrs
    if isinstance(step, AllGather):
        attrs = {"dim": step.dim, "axis": m.names[step.axis]}
    else:
        attrs = {"src_dim": step.src_dim, "dst_dim": step.dst_dim, "axis": m.names[step.axis]}
    group = sorted(m.group_along(t.rank, (step.axis,)))
    attrs |= {"group": group, "group_size": len(group), "fusion": 0}
    return attrs


def _redistribution(t: _Text, value: str, rp: RedistributionPlan, who: str) -> str:
    """Write the steps of `rp` applied to `value`; returns the resulting value's name."""
    before = rp.src
    for j, (step, after) in enumerate(zip(rp.steps, rp.layouts, strict=True)):
        attrs: dict[str, object] = {"instance name": f"{who}/redistribution_{j}"}
        attrs |= _step_attrs(step, before.matrix, t)
        local_in, local_out = before.local_shape(rp.shape), after.local_shape(rp.shape)
        if isinstance(step, Slice):
            c, n = before.matrix.coord(t.rank)[step.axis], local_out[step.dim]
            attrs["keep"] = f"[{c * n}:{(c + 1) * n}]"
        elif t.level >= 2:
            attrs["send_bytes"] = rp.step_bytes[j]
        t.sent += rp.step_bytes[j]
        if t.level >= 3:
            attrs["layout_after"] = fmt_layout(after)
        kind = "StridedSlice" if isinstance(step, Slice) else type(step).__name__
        value = t.op(kind, value, attrs, fmt_shapes([local_in]), fmt_shapes([local_out]))
        before = after
    return value


def _pre_comm_shapes(cp: CallPlan) -> list[list[Shape]]:
    """Local output shapes before each comm (index j: before comm j; last: after all)."""
    shapes = [t.local_shape(s) for t, s in zip(cp.outputs, cp.plan.output_shapes, strict=True)]
    stages = [list(shapes)]
    for c in reversed(cp.plan.comms):
        if c.kind == "ReduceScatter" and c.dim is not None:
            s = list(shapes[c.output])
            s[c.dim] *= c.group_size(cp.plan.matrix)
            shapes[c.output] = tuple(s)
        stages.insert(0, list(shapes))
    return stages


def _comm(t: _Text, value: str, c: Comm, cp: CallPlan, shapes: tuple[Shape, Shape], j: int) -> str:
    group = sorted(c.group(cp.plan.matrix, t.rank))
    attrs: dict[str, object] = {"instance name": f"{cp.call.module.module_path}/forward_op_{j}"}
    attrs |= {"op": c.op, "axes": "(" + ", ".join(c.axes) + ")"}
    if c.dim is not None:
        attrs["dim"] = c.dim
    attrs |= {"group": group, "group_size": len(group), "fusion": 0}
    sent = bytes_bound(c.kind, ITEMSIZE * math.prod(shapes[0]), len(group))
    t.sent += sent
    if t.level >= 2:
        attrs["send_bytes"] = sent
    return t.op(c.kind, value, attrs, fmt_shapes([shapes[0]]), fmt_shapes([shapes[1]]))


def _call(t: _Text, i: int, plan: NetworkPlan, operands: list[str]) -> list[str]:
    """Write call `i` and its comms; returns its output value names."""
    cp = plan.calls[i]
    module = cp.call.module
    stages = _pre_comm_shapes(cp)
    attrs: dict[str, object] = {"instance name": module.module_path}
    prim = module.init_args()
    if prim:
        attrs["primitive_attrs"] = fmt_attrs(prim)
    strat = strategies(cp)
    attrs |= {"in_strategy": strat["in_strategy"], "out_strategy": strat["out_strategy"]}
    live = [c for c in cp.plan.comms if c.group_size(cp.plan.matrix) > 1]
    if live:
        attrs["partial"] = "; ".join(str(c) for c in live)
    ins = fmt_shapes(cp.plan.local_input_shapes())
    name = t.op(module.name, ", ".join(operands), attrs, ins, fmt_shapes(stages[0]))
    if t.level >= 2:
        t.lines.append(f"#   rank {t.rank} blocks: {_blocks(cp, t.rank)}")
    n = len(cp.outputs)
    outs = [name if n == 1 else f"{name}[{k}]" for k in range(n)]
    for j, c in enumerate(cp.plan.comms):
        if c.group_size(cp.plan.matrix) > 1:
            shapes = (stages[j][c.output], stages[j + 1][c.output])
            outs[c.output] = _comm(t, outs[c.output], c, cp, shapes, j)
    return outs


def _blocks(cp: CallPlan, rank: int) -> str:
    ins = ", ".join(
        fmt_slice(x, rank, s) for x, s in zip(cp.inputs, cp.call.input_shapes, strict=True)
    )
    outs = ", ".join(
        fmt_slice(x, rank, s) for x, s in zip(cp.outputs, cp.plan.output_shapes, strict=True)
    )
    return f"({ins}) -> ({outs})"


def format_execute(plan: NetworkPlan, flow: Dataflow, rank: int, level: int = 1) -> str:
    """The text of ``rank_<rank>/execute.ir`` (pure).

    Args:
        plan: the network's plan (`shardwise.parallel.plan_network`).
        flow: where each call's inputs come from (`trace_sources`).
        rank: the rank whose local shapes and groups are shown.
        level: the ``save_graphs`` level (1, 2 or 3).

    Raises:
        ValueError: a bad level or rank, or `flow` not matching `plan`.
    """
    check_level(level, rank, plan)
    redists = input_redistributions(plan, flow)
    t = _Text(rank, level)
    t.lines += [*declarations(plan, flow, local=True), ""]
    results: dict[tuple[int, int], str] = {}
    for i, cp in enumerate(plan.calls):
        operands = []
        for k, (src, rp) in enumerate(zip(flow.calls[i], redists[i], strict=True)):
            value = source_name(src, results)
            who = f"{cp.call.module.module_path}/in{k}"
            if src.kind in ("torch", "const"):
                t.lines.append(f"# {who}: {_UNTRACKED[src.kind]}")
            operands.append(value if rp is None else _redistribution(t, value, rp, who))
        for k, name in enumerate(_call(t, i, plan, operands)):
            results[(i, k)] = name
    finals = []
    for k, (src, rp) in enumerate(output_redistributions(plan, flow.outputs)):
        value = source_name(src, results)
        finals.append(value if rp is None else _redistribution(t, value, rp, f"output{k}"))
    t.lines.append(f"return({', '.join(finals)})")
    head = header("execute", plan, rank, level)
    head.append("# shapes are this rank's local blocks; group: the global ranks of each collective")
    if level >= 2:
        head.append(f"# bytes this rank sends in one forward: {t.sent}")
    return "\n".join([*head, "", *t.lines]) + "\n"
