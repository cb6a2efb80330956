"""The IR dumps of a `planner.ParallelPlan` (networks of plain torch ops).

- `format_plan_begin`: ``step_parallel_begin.ir``: every op with its global output shapes, the
  placements of its inputs and outputs, and where its strategy came from.
- `format_plan_execute`: ``execute.ir`` for one rank: every op's local output shapes, and every
  forward collective the plan inserts with this rank's group and the bytes it sends.
- `dump_parallel_plan`: writes both per rank when ``save_graphs >= 1`` (level 2: this rank's
  blocks in ``execute.ir``; level 3: every rank's blocks, the slice table, in
  ``step_parallel_begin.ir``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

from shardwise.communication.recorder import bytes_bound
from shardwise.context import get_context
from shardwise.layout import DeviceMatrix
from shardwise.planner import Collective, EdgePlan, NodePlan, ParallelPlan
from shardwise.redistribution import Slice, plan_redistribution
from shardwise.report._format import fmt_slice
from shardwise.report._write import BEGIN_FILE, EXECUTE_FILE, _ranks, write_ir


def _blocks(n: NodePlan, rank: int) -> str:
    """The blocks of node `n`'s inputs and outputs that `rank` holds (global index ranges)."""
    ins = ", ".join(
        fmt_slice(p.layout, rank, s) for p, s in zip(n.inputs, n.in_shapes, strict=False)
    )
    outs = ", ".join(fmt_slice(p.layout, rank, s) for p, s in zip(n.outputs, n.shapes, strict=True))
    return f"({ins}) -> ({outs})"


def format_plan_begin(plan: ParallelPlan, level: int = 1) -> str:
    """The whole plan, one op per line (`str(plan)`), under a header; at level 3, under every
    op the slice table (every rank's block of each input and output)."""
    if level < 3:
        return f"# step_parallel_begin: {len(plan.nodes)} ops\n{plan}\n"
    lines = [f"# step_parallel_begin: {len(plan.nodes)} ops"]
    by_index = {n.index: n for n in plan.nodes}
    for line in str(plan).splitlines():
        lines.append(line)
        head = line.strip()
        if head.startswith("%") and " [" in head:
            node = by_index[int(head[1:].split(" ", 1)[0])]
            lines += [f"    # rank {r}: {_blocks(node, r)}" for r in plan.matrix.rank_list]
    return "\n".join(lines) + "\n"


def _edge_bytes(e: EdgePlan, rank: int) -> list[tuple[Collective, list[int], int]]:
    """This edge's collectives with this rank's group and the bytes it sends in each."""
    m = e.src.layout.matrix
    if e.shared:
        return []
    size = int(getattr(torch, e.dtype).itemsize)
    out = []
    if e.reduced:
        n = math.prod(e.src.layout.local_shape(e.shape)) * size
        group = sorted(m.group_along(rank, e.reduced))
        c = Collective("AllReduce", tuple(m.names[a] for a in e.reduced), "", e.src.reduce)
        out.append((c, group, bytes_bound("AllReduce", n, len(group))))
    if e.steps:
        moved = plan_redistribution(e.src.layout, e.dst.layout, e.shape, size)
        for step, sent in zip(moved.steps, moved.step_bytes, strict=True):
            if isinstance(step, Slice) or m.shape[step.axis] == 1:
                continue
            group = sorted(m.group_along(rank, (step.axis,)))
            c = Collective(type(step).__name__, (m.names[step.axis],), "")
            out.append((c, group, sent))
    return out


def _node_bytes(n: NodePlan, m: DeviceMatrix, rank: int) -> list[tuple[Collective, list[int], int]]:
    """An op's own collectives with this rank's group and the bytes it sends (float32)."""
    out = []
    for c in n.comms:
        group = sorted(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
        local = math.prod(n.local_shapes[c.output]) * 4
        if c.kind == "ReduceScatter":
            local *= len(group)  # (the unscattered input)
        out.append((c, group, bytes_bound(c.kind, local, len(group))))
    return out


def format_plan_execute(plan: ParallelPlan, rank: int, level: int = 1) -> str:
    """This rank's local shapes and forward collectives: each with its group (the ranks this
    rank runs it with) and the bytes this rank sends (``send_bytes``), and their total; from
    level 2, under every op this rank's block of each input and output."""
    m = plan.matrix
    lines = [f"# execute: rank {rank} of {plan.device_num} on {m}"]
    by_consumer: dict[int, list[EdgePlan]] = {}
    for e in plan.edges:
        by_consumer.setdefault(e.consumer, []).append(e)
    total = 0

    def put(found: list[tuple[Collective, list[int], int]], where: str) -> None:
        nonlocal total
        for c, group, sent in found:
            detail = f"({c.detail})" if c.detail else ""
            axes = ", ".join(c.axes)
            lines.append(
                f"    {c.kind}{detail} over {axes} at {where} group {group} send_bytes {sent}"
            )
            total += sent

    for e in by_consumer.get(-2, []):
        put(_edge_bytes(e, rank), "entry")
    for n in plan.nodes:
        for e in by_consumer.get(n.index, []):
            put(_edge_bytes(e, rank), f"{n.name} input {e.slot}")
        shapes = ", ".join(str(list(s)) for s in n.local_shapes)
        lines.append(f"  %{n.index} {n.name}: local {shapes}")
        if level >= 2:
            lines.append(f"    block {_blocks(n, rank)}")
        put(_node_bytes(n, m, rank), n.name)
    for e in by_consumer.get(-1, []):
        put(_edge_bytes(e, rank), f"return {e.slot}")
    lines.append(f"# bytes this rank sends in one forward: {total}")
    return "\n".join(lines) + "\n"


def dump_parallel_plan(plan: ParallelPlan, ranks: Iterable[int] | None = None) -> list[Path]:
    """Write ``step_parallel_begin.ir`` and ``execute.ir`` of `plan` per rank if
    ``get_context("save_graphs") >= 1``.

    Returns:
        The paths written (empty at level 0).
    """
    level = int(get_context("save_graphs"))
    if level < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    chosen = _ranks(cast(Any, plan)) if ranks is None else list(ranks)
    paths = []
    begin = format_plan_begin(plan, level)
    for r in chosen:
        paths.append(write_ir(root, r, BEGIN_FILE, begin))
        paths.append(write_ir(root, r, EXECUTE_FILE, format_plan_execute(plan, r, level)))
    return paths
