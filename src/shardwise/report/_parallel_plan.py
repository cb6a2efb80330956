"""The IR dumps of a `planner.ParallelPlan` (networks of plain torch ops).

- `format_plan_begin`: ``step_parallel_begin.ir``: every op with its global output shapes, the
  placements of its inputs and outputs, and where its strategy came from.
- `format_plan_execute`: ``execute.ir`` for one rank: every op's local output shapes, and every
  collective the plan inserts with this rank's group.
- `dump_parallel_plan`: writes both per rank when ``save_graphs >= 1``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from shardwise.context import get_context
from shardwise.planner import ParallelPlan
from shardwise.report._write import BEGIN_FILE, EXECUTE_FILE, _ranks, write_ir


def format_plan_begin(plan: ParallelPlan) -> str:
    """The whole plan, one op per line (`str(plan)`), under a header."""
    return f"# step_parallel_begin: {len(plan.nodes)} ops\n{plan}\n"


def format_plan_execute(plan: ParallelPlan, rank: int) -> str:
    """This rank's local shapes and collectives (with the ranks of each group)."""
    m = plan.matrix
    lines = [f"# execute: rank {rank} of {plan.device_num} on {m}"]
    by_consumer: dict[int, list[Any]] = {}
    for e in plan.edges:
        by_consumer.setdefault(e.consumer, []).append(e)

    def comms(edges: list[Any], where: str) -> None:
        for e in edges:
            for c in e.collectives(where):
                axes = tuple(m.names.index(a) for a in c.axes)
                group = sorted(m.group_along(rank, axes))
                lines.append(f"    {c} group {group}")

    comms(by_consumer.get(-2, []), "entry")
    for n in plan.nodes:
        comms(by_consumer.get(n.index, []), f"{n.name} input")
        shapes = ", ".join(str(list(s)) for s in n.local_shapes)
        lines.append(f"  %{n.index} {n.name}: local {shapes}")
        for c in n.comms:
            axes = tuple(m.names.index(a) for a in c.axes)
            lines.append(f"    {c} group {sorted(m.group_along(rank, axes))}")
    comms(by_consumer.get(-1, []), "return")
    return "\n".join(lines) + "\n"


def dump_parallel_plan(plan: ParallelPlan, ranks: Iterable[int] | None = None) -> list[Path]:
    """Write ``step_parallel_begin.ir`` and ``execute.ir`` of `plan` per rank if
    ``get_context("save_graphs") >= 1``.

    Returns:
        The paths written (empty at level 0).
    """
    if int(get_context("save_graphs")) < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    chosen = _ranks(cast(Any, plan)) if ranks is None else list(ranks)
    paths = []
    begin = format_plan_begin(plan)
    for r in chosen:
        paths.append(write_ir(root, r, BEGIN_FILE, begin))
        paths.append(write_ir(root, r, EXECUTE_FILE, format_plan_execute(plan, r)))
    return paths
