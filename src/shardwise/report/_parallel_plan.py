"""The IR dumps of a `planner.ParallelPlan` (networks of plain torch ops).

- `format_plan_begin`: ``step_parallel_begin.ir``: every op with its global output shapes, the
  placements of its inputs and outputs, and where its strategy came from.
- `format_plan_execute`: ``execute.ir`` for one rank: every op's local output shapes, every
  forward collective the plan inserts with this rank's group and the bytes it sends, and every
  local slice of an edge (`LocalSlice`: MindSpore's ``StridedSlice``, nothing sent).
- `dump_parallel_plan`: writes both per rank when ``save_graphs >= 1`` (level 2: this rank's
  blocks in ``execute.ir``; level 3: every rank's blocks, the slice table, in
  ``step_parallel_begin.ir``); a plan made again for other ops or shapes goes to
  ``step_parallel_begin_<k>.ir`` / ``execute_<k>.ir``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.communication.recorder import bytes_bound
from shardwise.context import get_context
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner import Collective, EdgePlan, NodePlan, ParallelPlan
from shardwise.redistribution import Slice, plan_redistribution
from shardwise.report._write import BEGIN_FILE, EXECUTE_FILE, report_ranks, write_ir


def fmt_slice(layout: TensorLayout, rank: int, shape: Sequence[int]) -> str:
    """The block of a global tensor `rank` holds: ``[0:16, 0:196]`` (a strided dim: its range
    in every group, ``[0:16+32:48+64:80, 0:32]``)."""
    ranges = layout.local_ranges(rank, shape)
    return "[" + ", ".join("+".join(f"{r.start}:{r.stop}" for r in rs) for rs in ranges) + "]"


def _blocks(n: NodePlan, rank: int) -> str:
    """The blocks of node `n`'s inputs and outputs that `rank` holds (global index ranges)."""
    ins = ", ".join(
        fmt_slice(p.layout, rank, s) for p, s in zip(n.inputs, n.in_shapes, strict=False)
    )
    outs = ", ".join(fmt_slice(p.layout, rank, s) for p, s in zip(n.outputs, n.shapes, strict=True))
    return f"({ins}) -> ({outs})"


def check_level(level: int, plan: ParallelPlan, rank: int | None = None) -> None:
    """A report level of 1 to 3 and a rank of the plan's matrix.

    Raises:
        ValueError: either is out of range.
    """
    if level not in (1, 2, 3):
        raise ValueError(f"report level {level}; valid: 1, 2, 3 (save_graphs)")
    if rank is not None and rank not in plan.matrix.rank_list:
        raise ValueError(
            f"report for rank {rank}: the plan's device matrix {plan.matrix} has ranks "
            f"{min(plan.matrix.rank_list)} to {max(plan.matrix.rank_list)}"
        )


def in_strategy(n: NodePlan) -> tuple[tuple[int, ...], ...]:
    """Node `n`'s strategy in MindSpore's notation (`NodePlan.in_strategy`)."""
    return n.in_strategy


def format_plan_begin(plan: ParallelPlan, level: int = 1) -> str:
    """The whole plan, one op per line (`str(plan)`), under a header; under every op with
    inputs its strategy (`in_strategy`) and where it came from; at level 3 also the slice table
    (every rank's block of each input and output). A plan an automatic planner made ends with
    why each op has its strategy (`ParallelPlan.explained`: the source and the cheapest
    alternatives with their communication / compute / memory costs).

    Raises:
        ValueError: a level outside 1 to 3.
    """
    check_level(level, plan)
    lines = [f"# step_parallel_begin: {len(plan.nodes)} ops"]
    by_index = {n.index: n for n in plan.nodes}
    for line in str(plan).splitlines():
        lines.append(line)
        head = line.strip()
        if not (head.startswith("%") and " [" in head):
            continue
        node = by_index[int(head[1:].split(" ", 1)[0])]
        if node.in_shapes:
            lines.append(f"    in_strategy {in_strategy(node)} from {node.rule}")
        if level >= 3:
            lines += [f"    # rank {r}: {_blocks(node, r)}" for r in plan.matrix.rank_list]
    if plan.explained:
        lines.append(
            f"# {plan.mode}: why each op has its strategy (alternatives with their cost: "
            f"communication on its edges, its neighbours as chosen; compute; memory per rank)"
        )
        lines += [f"  {line}" for e in plan.explained.values() for line in str(e).splitlines()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class LocalSlice:
    """A `Slice` step of an edge on one rank: a local ``StridedSlice`` of the block it holds.

    Attributes:
        step: the step as the plan prints it, ``Slice(dim=1, axis=g1, 4 parts)``.
        begin, end: the kept range, per dim, in the coordinates of this rank's block before
            the step (MindSpore's ``StridedSlice(x, begin, end, strides)``, strides 1).
        local: this rank's block shape before the step.
        groups: per dim, the strided group count (``()``: plain): the kept range is then
            the same in each group's piece of the block, and `begin` / `end` are within it.
    """

    step: str
    begin: tuple[int, ...]
    end: tuple[int, ...]
    local: tuple[int, ...]
    groups: tuple[int, ...] = ()

    def then(self, later: LocalSlice) -> LocalSlice:
        """This slice followed by `later` (a slice of the block this one keeps): one
        ``StridedSlice``, as consecutive Slice steps run."""
        return LocalSlice(
            f"{self.step}; {later.step}",
            tuple(b + lb for b, lb in zip(self.begin, later.begin, strict=True)),
            tuple(b + le for b, le in zip(self.begin, later.end, strict=True)),
            self.local,
            self.groups or later.groups,
        )

    def __str__(self) -> str:
        strides = tuple(1 for _ in self.begin)
        per = f" in each strided group (groups {list(self.groups)})" if self.groups else ""
        return (
            f"StridedSlice({self.begin}, {self.end}, {strides}){per} of local "
            f"{list(self.local)} send_bytes 0"
        )


def _local_slice(
    step: Slice, before: TensorLayout, after: TensorLayout, rank: int, shape: Sequence[int]
) -> LocalSlice:
    """`step` on `rank`: the part of its block (under `before`) it keeps (under `after`);
    in a strided dim, the part of each group's piece (the same in every group)."""
    held = [rs[0] for rs in before.local_ranges(rank, shape)]
    kept = [rs[0] for rs in after.local_ranges(rank, shape)]
    return LocalSlice(
        step.describe(before.matrix),
        tuple(k.start - h.start for h, k in zip(held, kept, strict=True)),
        tuple(k.stop - h.start for h, k in zip(held, kept, strict=True)),
        before.local_shape(shape),
        after.groups,
    )


Found = tuple[Collective, list[int], int] | LocalSlice
"""A collective with this rank's group and the bytes it sends, or a local slice."""


def _edge_bytes(e: EdgePlan, rank: int) -> list[Found]:
    """This edge's collectives with this rank's group and the bytes it sends in each, and its
    local slices, in the order they run."""
    m = e.src.layout.matrix
    if e.shared:
        return []
    size = int(getattr(torch, e.dtype).itemsize)
    out: list[Found] = []
    if e.reduced:
        n = math.prod(e.src.layout.local_shape(e.shape)) * size
        group = sorted(m.group_along(rank, e.reduced))
        c = Collective("AllReduce", tuple(m.names[a] for a in e.reduced), "", e.src.reduce)
        out.append((c, group, bytes_bound("AllReduce", n, len(group))))
    if e.steps:
        moved = plan_redistribution(e.src.layout, e.dst.layout, e.shape, size)
        befores = (moved.src, *moved.layouts[:-1])
        for step, before, after, sent in zip(
            moved.steps, befores, moved.layouts, moved.step_bytes, strict=True
        ):
            if m.shape[step.axis] == 1:
                continue
            if isinstance(step, Slice):
                cut = _local_slice(step, before, after, rank, e.shape)
                last = out[-1] if out else None
                if isinstance(last, LocalSlice):  # consecutive slices: one StridedSlice
                    out[-1] = last.then(cut)
                else:
                    out.append(cut)
                continue
            group = sorted(m.group_along(rank, (step.axis,)))
            c = Collective(type(step).__name__, (m.names[step.axis],), "")
            out.append((c, group, sent))
    return out


def _node_bytes(n: NodePlan, m: DeviceMatrix, rank: int) -> list[Found]:
    """An op's own collectives with this rank's group and the bytes it sends."""
    out: list[Found] = []
    for c in n.comms:
        group = sorted(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
        itemsize = int(getattr(torch, n.dtype(c.output)).itemsize)
        local = math.prod(n.local_shapes[c.output]) * itemsize
        if c.kind == "ReduceScatter":
            local *= len(group)  # (the unscattered input)
        out.append((c, group, bytes_bound(c.kind, local, len(group))))
    return out


def format_plan_execute(plan: ParallelPlan, rank: int, level: int = 1) -> str:
    """This rank's local shapes and forward collectives: each with its group (the ranks this
    rank runs it with) and the bytes this rank sends (``send_bytes``), and their total; each
    local slice of an edge (``Slice(dim=1, axis=g1, 4 parts) at relu/ReLU input 0:
    StridedSlice((0, 0), (8, 4), (1, 1)) of local [8, 16] send_bytes 0``); from level 2, under
    every op this rank's block of each input and output.

    Raises:
        ValueError: a level outside 1 to 3, or a rank outside the plan's matrix.
    """
    check_level(level, plan, rank)
    m = plan.matrix
    lines = [f"# execute: rank {rank} of {plan.device_num} on {m}"]
    by_consumer: dict[int, list[EdgePlan]] = {}
    for e in plan.edges:
        by_consumer.setdefault(e.consumer, []).append(e)
    total = 0

    def put(found: list[Found], where: str) -> None:
        nonlocal total
        for item in found:
            if isinstance(item, LocalSlice):
                lines.append(f"    {item.step} at {where}: {item}")
                continue
            c, group, sent = item
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


def dump_parallel_plan(
    plan: ParallelPlan, ranks: Iterable[int] | None = None, variant: int = 0
) -> list[Path]:
    """Write ``step_parallel_begin.ir`` and ``execute.ir`` of `plan` per rank if
    ``get_context("save_graphs") >= 1``.

    Args:
        plan: the plan.
        ranks: the ranks to write (default: `report_ranks`).
        variant: 0 for a wrapper's first plan; k > 0 for the k-th plan made again (other
            ops or shapes), written as ``step_parallel_begin_<k>.ir`` / ``execute_<k>.ir``.

    Returns:
        The paths written (empty at level 0).
    """
    level = int(get_context("save_graphs"))
    if level < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    chosen = report_ranks(plan.matrix) if ranks is None else list(ranks)
    paths = []
    begin = format_plan_begin(plan, level)
    begin_file, execute_file = BEGIN_FILE, EXECUTE_FILE
    if variant:
        begin_file = begin_file.replace(".ir", f"_{variant}.ir")
        execute_file = execute_file.replace(".ir", f"_{variant}.ir")
    for r in chosen:
        paths.append(write_ir(root, r, begin_file, begin))
        paths.append(write_ir(root, r, execute_file, format_plan_execute(plan, r, level)))
    return paths
