"""The IR dumps of a `planner.ParallelPlan` (networks of plain torch ops).

- `format_plan_begin`: ``step_parallel_begin.ir``: every op with its global input and output
  shapes, the placements of its inputs and outputs, its ``in_strategy`` (and where it came
  from) and ``out_strategy``.
- `format_plan_execute`: ``execute.ir`` for one rank: every op's local output shapes, every
  forward collective the plan inserts with this rank's group, its fusion id (0: operator
  collectives are not fused; the gradient buckets' ids are the optimizer section's) and the
  bytes it sends, and every
  local slice of an edge (`_sends.LocalSlice`: MindSpore's ``StridedSlice``, nothing sent);
  then the backward's collectives (`_backward_lines`: each forward collective's adjoint and the
  plan's gradient averages, in the order autograd runs them).
- `dump_parallel_plan`: writes both per rank when ``save_graphs >= 1`` (level 2: this rank's
  blocks in ``execute.ir``; level 3: every rank's blocks, the slice table, in
  ``step_parallel_begin.ir``), then the plan pictures (`_pictures.dump_plan_pictures`:
  ``plan.html``, ``plan.png``); a plan made again for other ops or shapes goes to
  ``step_parallel_begin_<k>.ir`` / ``execute_<k>.ir`` (``plan_<k>.html`` / ``plan_<k>.png``).
  A process's first write into a rank directory removes the numbered files of those kinds an
  earlier run left there (`_clear_numbered`: a run that makes fewer plans leaves none behind).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from numbers import Integral
from pathlib import Path

from shardwise.context import get_context
from shardwise.planner import NodePlan, ParallelPlan
from shardwise.report._pictures import dump_plan_pictures
from shardwise.report._plan_data import Memory
from shardwise.report._sends import Found, LocalSlice, edge_sends, fmt_slice, node_sends
from shardwise.report._summary import op_traffic
from shardwise.report._write import BEGIN_FILE, EXECUTE_FILE, report_ranks, write_ir


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
        TypeError: a rank that is not an integer (a bool, a float).
        ValueError: either is out of range.
    """
    if level not in (1, 2, 3):
        raise ValueError(f"report level {level}; valid: 1, 2, 3 (save_graphs)")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, Integral)):
        raise TypeError(
            f"report for rank {rank!r}: the rank must be an int, one of the plan's device "
            f"matrix {plan.matrix} ranks {min(plan.matrix.rank_list)} to "
            f"{max(plan.matrix.rank_list)}"
        )
    if rank is not None and rank not in plan.matrix.rank_list:
        raise ValueError(
            f"report for rank {rank}: the plan's device matrix {plan.matrix} has ranks "
            f"{min(plan.matrix.rank_list)} to {max(plan.matrix.rank_list)}"
        )


def in_strategy(n: NodePlan) -> tuple[tuple[int, ...], ...]:
    """Node `n`'s strategy in MindSpore's notation (`NodePlan.in_strategy`)."""
    return n.in_strategy


def out_strategy(n: NodePlan, axes: tuple[str, ...]) -> str:
    """Node `n`'s outputs' split counts in MindSpore's notation, each partial output with the
    axes it is a partial sum over (``((4, 1) partial over g1,)``: a row-parallel linear)."""
    parts = []
    for counts, placed in zip(n.out_strategy, n.outputs, strict=True):
        over = ", ".join(axes[a] for a in placed.partial)
        parts.append(f"{counts}" + (f" partial over {over}" if over else ""))
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def format_plan_begin(plan: ParallelPlan, level: int = 1) -> str:
    """The whole plan, one op per line (`str(plan)`), under a header; under every op with
    inputs its strategy (`in_strategy`), where it came from and the inputs' global shapes, and
    its outputs' split counts (`out_strategy`); at level 3 also the slice table (every rank's
    block of each input and output). A plan an automatic planner made ends with
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
            shapes = ", ".join(str(list(s)) for s in node.in_shapes)
            lines.append(f"    in_strategy {in_strategy(node)} from {node.rule}; inputs {shapes}")
        if node.outputs:
            lines.append(f"    out_strategy {out_strategy(node, plan.matrix.names)}")
        if level >= 3:
            lines += [f"    # rank {r}: {_blocks(node, r)}" for r in plan.matrix.rank_list]
    if plan.explained:
        lines.append(
            f"# {plan.mode}: why each op has its strategy (alternatives with their cost: "
            f"communication on its edges, its neighbours as chosen; compute; memory per rank)"
        )
        lines += [f"  {line}" for e in plan.explained.values() for line in str(e).splitlines()]
    return "\n".join(lines) + "\n"


def format_plan_execute(plan: ParallelPlan, rank: int, level: int = 1) -> str:
    """This rank's local shapes and forward collectives: each with its group (the ranks this
    rank runs it with) and the bytes this rank sends (``send_bytes``), and their total; each
    local slice of an edge (``Slice(dim=1, axis=g1, 4 parts) at relu/ReLU input 0:
    StridedSlice((0, 0), (8, 4), (1, 1)) of local [8, 16] send_bytes 0``); from level 2, under
    every op this rank's block of each input and output.

    Raises:
        TypeError: a rank that is not an int (a bool, a float).
        ValueError: a level outside 1 to 3, or a rank outside the plan's matrix.
    """
    check_level(level, plan, rank)
    rank = int(rank)  # (a NumPy integer prints as an int)
    m = plan.matrix
    lines = [f"# execute: rank {rank} of {plan.device_num} on {m}"]
    by_consumer = plan.edges_by_consumer()
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
                f"    {c.kind}{detail} over {axes} at {where} group {group} fusion 0 "
                f"send_bytes {sent}"
            )
            total += sent

    for e in by_consumer.get(-2, []):
        put(edge_sends(e, rank), "entry")
    for n in plan.nodes:
        for e in by_consumer.get(n.index, []):
            put(edge_sends(e, rank), f"{n.name} input {e.slot}")
        shapes = ", ".join(str(list(s)) for s in n.local_shapes)
        lines.append(f"  %{n.index} {n.name}: local {shapes}")
        if level >= 2:
            lines.append(f"    block {_blocks(n, rank)}")
        put(node_sends(n, m, rank), n.name)
    for e in by_consumer.get(-1, []):
        put(edge_sends(e, rank), f"return {e.slot}")
    lines.append(f"# bytes this rank sends in one forward: {total}")
    lines += _backward_lines(plan, rank)
    return "\n".join(lines) + "\n"


def _backward_lines(plan: ParallelPlan, rank: int) -> list[str]:
    """The backward section of ``execute.ir``: the adjoints of the forward's collectives and
    the plan's gradient averages (`_summary.op_traffic`), in the order backward runs them, then
    each checkpointed region's recomputed collectives (the gradient buckets are the optimizer
    section's)."""
    m = plan.matrix
    lines = [
        "# backward (autograd runs them in this order): the adjoints of the forward's "
        "collectives and the plan's gradient averages"
    ]
    total = 0
    found = op_traffic(plan, rank)
    traffic = found.rows
    rows = [(i, c, sent) for i, (phase, c, sent) in enumerate(traffic) if phase == "backward"]
    names = {n.index: n.name for n in plan.nodes}
    alike = {
        f"{names[e.consumer]} input {e.slot}" for e in plan.edges if e.seeded and e.consumer >= 0
    }
    for i, c, sent in reversed(rows):
        group = sorted(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
        read_alike = c.kind == "AllReduce" and c.where in alike  # (`EdgePlan.seeded`)
        seeded = i in found.none_in_step or read_alike  # (`replicated_seed`)
        note = " (none when backward starts there: loss.backward())" if seeded else ""
        if read_alike:
            note = " (none in loss.backward(): only ops alike on every rank read it)"
        lines.append(
            f"    {c.kind} over {', '.join(c.axes)} at {c.where} group {group} fusion 0 "
            f"send_bytes {sent}{note}"
        )
        total += 0 if seeded else sent
    again = [(c, sent) for phase, c, sent in traffic if phase == "recompute"]
    if plan.regions:
        lines.append(
            "# recomputed in backward (activation checkpointing): each region's forward "
            "collectives again, labelled 'recompute from <its first op>'"
        )
        lines += [f"    {r}" for r in plan.regions]
    for c, sent in again:
        group = sorted(m.group_along(rank, tuple(m.names.index(a) for a in c.axes)))
        detail = f"({c.detail})" if c.detail else ""
        lines.append(
            f"    {c.kind}{detail} over {', '.join(c.axes)} at {c.where} group {group} "
            f"fusion 0 send_bytes {sent}"
        )
        total += sent
    lines.append(f"# bytes this rank sends in one backward (those marked none left out): {total}")
    return lines


_WRITTEN: dict[str, int] = {}  # save_graphs_path (resolved) -> plans written there so far
_ENTERED: set[str] = set()  # rank directories (resolved) this process has written into
_NUMBERED = re.compile(
    r"(?:step_parallel_begin|execute)_[1-9][0-9]*\.ir|plan_[1-9][0-9]*\.(?:html|png)"
)


def _clear_numbered(directory: Path) -> None:
    """At this process's first write into `directory`, remove the numbered plan files
    (``step_parallel_begin_<k>.ir``, ``execute_<k>.ir``, ``plan_<k>.html``, ``plan_<k>.png``)
    an earlier run left there; nothing else is touched, and nothing this process wrote."""
    key = str(directory.resolve())
    if key in _ENTERED:
        return
    _ENTERED.add(key)
    if directory.is_dir():
        for f in directory.iterdir():
            if _NUMBERED.fullmatch(f.name) and f.is_file():
                f.unlink(missing_ok=True)


def next_variant() -> int:
    """The number of the next plan this process writes under ``save_graphs_path``: 0 for the
    first (``step_parallel_begin.ir``), then 1, 2, ... for every further one, a plan made again
    or another wrapped network's (which overwrote the first network's files); 0 when
    ``save_graphs`` is off (nothing counted).

    Example:
        >>> dump_parallel_plan(plan, variant=next_variant())  # doctest: +SKIP
    """
    if int(get_context("save_graphs")) < 1:
        return 0
    key = str(Path(get_context("save_graphs_path")).resolve())
    k = _WRITTEN.get(key, 0)
    _WRITTEN[key] = k + 1
    return k


def dump_parallel_plan(
    plan: ParallelPlan,
    ranks: Iterable[int] | None = None,
    variant: int = 0,
    memory: Memory | None = None,
) -> list[Path]:
    """Write ``step_parallel_begin.ir`` and ``execute.ir`` of `plan` per rank if
    ``get_context("save_graphs") >= 1``, and the plan pictures: ``plan.html`` per rank and
    ``plan.png`` under the plan's first rank (`_pictures.dump_plan_pictures`). The first
    write of this process into a rank directory removes the numbered plan files an earlier
    run left there (`_clear_numbered`).

    Args:
        plan: the plan.
        ranks: the ranks to write (default: `report_ranks`).
        variant: 0 for a wrapper's first plan; k > 0 for the k-th plan made again (other
            ops or shapes), written as ``step_parallel_begin_<k>.ir`` / ``execute_<k>.ir``
            (and ``plan_<k>.html`` / ``plan_<k>.png``).
        memory: rank -> {kind: bytes} for the pictures' memory bars (None: `plan_memory`).

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
        _clear_numbered(root / f"rank_{r}")
        paths.append(write_ir(root, r, begin_file, begin))
        paths.append(write_ir(root, r, execute_file, format_plan_execute(plan, r, level)))
    return paths + dump_plan_pictures(plan, root, chosen, variant, memory)
