"""What the plan pictures show, as plain data (no HTML, no matplotlib).

- `plan_memory`: each rank's bytes by kind (parameters, gradients, optimizer state,
  activations, communication buffers) from the blocks
  the plan gives it (`_memory.estimate_memory`).
- `memory_kinds` / `memory_groups`: the kinds in the order given, and consecutive ranks with
  equal breakdowns merged into one bar (at most `MAX_BARS` bars).
- `chosen_rank`: the rank a picture is drawn for (default: the plan's first), checked.
- `shown_ranks`: the ranks whose blocks a slice table lists (every rank up to `ALL_RANKS_UP_TO`
  devices, else the first `FIRST_RANKS` and the chosen one).
- `Sent` / `plan_sends`: per op, the collectives into it and its own, with one rank's group and
  the bytes it sends (`_sends`), and the local slices of its input edges.
- `comm_totals`: one forward's bytes by collective kind and axes.
- `matrix_rows`: the device matrix as rows of ranks to draw (the last axis across).
- `fmt_bytes`: ``1.5 MiB``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.layout import DeviceMatrix
from shardwise.planner import EdgePlan, ParallelPlan
from shardwise.report._sends import Found, LocalSlice, edge_sends, node_sends

Memory = Mapping[int, Mapping[str, int]]
"""rank -> {kind: bytes} (``"parameters"``, ``"gradients"``, ``"optimizer state"``, ...)."""

ALL_RANKS_UP_TO = 16
FIRST_RANKS = 8
MAX_BARS = 32
ENTRY, RETURN = -2, -1  # `EdgePlan.consumer` of an input's edge / a returned value's edge


def plan_memory(plan: ParallelPlan) -> dict[int, dict[str, int]]:
    """Each rank's bytes by kind at its peak under `plan` (`_memory.estimate_memory`, no
    optimizer known: its state left out): parameters, gradients, optimizer state, activations
    (the op outputs held for backward), communication buffers.

    Args:
        plan: the plan.

    Returns:
        rank -> {kind: bytes}, every rank of the plan's matrix (equal blocks: the same).

    Example:
        >>> plan_memory(plan)[0]["parameters"]  # seed 003, 8 devices, global batch 32
        552960
    """
    from shardwise.report._memory import estimate_memory

    parts = dict(estimate_memory(plan).parts)
    return {r: dict(parts) for r in plan.matrix.rank_list}


def memory_kinds(memory: Memory) -> list[str]:
    """Every kind of `memory`, in the order first given."""
    kinds: dict[str, None] = {}
    for parts in memory.values():
        kinds.update(dict.fromkeys(parts))
    return list(kinds)


@dataclass(frozen=True)
class MemoryBar:
    """Consecutive ranks `first` to `last` (in rank order) with the same breakdown `parts`."""

    first: int
    last: int
    parts: tuple[int, ...]

    @property
    def label(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    @property
    def total(self) -> int:
        return sum(self.parts)


def memory_groups(memory: Memory, kinds: Sequence[str]) -> tuple[list[MemoryBar], int]:
    """The bars to draw: ranks in order, consecutive ones with equal breakdowns merged; beyond
    `MAX_BARS` bars, the `MAX_BARS` largest totals, in rank order.

    Returns:
        The bars and how many were left out.
    """
    bars: list[MemoryBar] = []
    for r in sorted(memory):
        parts = tuple(int(memory[r].get(k, 0)) for k in kinds)
        if bars and bars[-1].parts == parts:
            bars[-1] = MemoryBar(bars[-1].first, r, parts)
        else:
            bars.append(MemoryBar(r, r, parts))
    if len(bars) <= MAX_BARS:
        return bars, 0
    kept = sorted(sorted(bars, key=lambda b: -b.total)[:MAX_BARS], key=lambda b: b.first)
    return kept, len(bars) - len(kept)


def chosen_rank(matrix: DeviceMatrix, rank: int | None) -> int:
    """`rank`, or the matrix's first rank when None.

    Raises:
        ValueError: `rank` is not a rank of `matrix`.
    """
    if rank is None:
        return matrix.rank_list[0]
    if rank not in matrix.rank_list:
        raise ValueError(
            f"plan picture for rank {rank}: the plan's device matrix {matrix} has ranks "
            f"{min(matrix.rank_list)} to {max(matrix.rank_list)}"
        )
    return rank


def shown_ranks(matrix: DeviceMatrix, rank: int) -> list[int]:
    """The ranks whose blocks the slice tables list: all of them up to `ALL_RANKS_UP_TO`
    devices, else the first `FIRST_RANKS` and `rank`."""
    ranks = list(matrix.rank_list)
    if len(ranks) <= ALL_RANKS_UP_TO:
        return ranks
    first = ranks[:FIRST_RANKS]
    return first if rank in first else [*first, rank]


@dataclass(frozen=True)
class Sent:
    """One collective or local slice on one rank.

    Attributes:
        where: ``"input 0"`` (an edge into the op), ``"op"`` (the op's own collective),
            ``"return 0"`` or ``"entry"``.
        kind: ``"AllReduce"``, ``"AllGather"``, ``"AlltoAll"``, ``"ReduceScatter"`` or
            ``"StridedSlice"`` (a local slice).
        what: the step as the IR prints it (``AllReduce(sum) over g1, g2``).
        axes: the axes it runs over (empty for a slice).
        group: the ranks this rank runs it with (empty for a slice).
        send_bytes: the bytes this rank sends.
    """

    where: str
    kind: str
    what: str
    axes: tuple[str, ...]
    group: tuple[int, ...]
    send_bytes: int


def _sent(where: str, found: Found) -> Sent:
    if isinstance(found, LocalSlice):
        return Sent(where, "StridedSlice", f"{found.step}: {found}", (), (), 0)
    c, group, sent = found
    detail = f"({c.detail})" if c.detail else ""
    what = f"{c.kind}{detail} over {', '.join(c.axes)}"
    return Sent(where, c.kind, what, c.axes, tuple(group), sent)


def edges_by_consumer(plan: ParallelPlan) -> dict[int, list[EdgePlan]]:
    """Consumer index -> its edges (`ENTRY` / `RETURN` for the plan's inputs and outputs)."""
    out: dict[int, list[EdgePlan]] = {}
    for e in plan.edges:
        out.setdefault(e.consumer, []).append(e)
    return out


def plan_sends(plan: ParallelPlan, rank: int) -> dict[int, list[Sent]]:
    """Node index (`ENTRY`, `RETURN` for the inputs' and outputs' edges) -> what `rank` runs
    there in one forward, in order: its input edges' steps, then the op's own collectives."""
    by_consumer = edges_by_consumer(plan)
    out: dict[int, list[Sent]] = {}
    for e in by_consumer.get(ENTRY, []):
        out.setdefault(ENTRY, []).extend(_sent("entry", f) for f in edge_sends(e, rank))
    for n in plan.nodes:
        sends = [
            _sent(f"input {e.slot}", f)
            for e in by_consumer.get(n.index, [])
            for f in edge_sends(e, rank)
        ]
        sends += [_sent("op", f) for f in node_sends(n, plan.matrix, rank)]
        out[n.index] = sends
    for e in by_consumer.get(RETURN, []):
        out.setdefault(RETURN, []).extend(_sent(f"return {e.slot}", f) for f in edge_sends(e, rank))
    return out


@dataclass(frozen=True)
class CommTotal:
    """One forward's collectives of one kind over the same axes: how many, and the bytes one
    rank sends in them."""

    kind: str
    axes: tuple[str, ...]
    count: int
    send_bytes: int

    @property
    def label(self) -> str:
        return f"{self.kind} over {', '.join(self.axes)}"


def comm_totals(sends: Mapping[int, Sequence[Sent]]) -> list[CommTotal]:
    """The collectives of `sends` (slices left out) by kind and axes, most bytes first."""
    acc: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {}
    for items in sends.values():
        for s in items:
            if s.kind == "StridedSlice":
                continue
            count, sent = acc.get((s.kind, s.axes), (0, 0))
            acc[(s.kind, s.axes)] = (count + 1, sent + s.send_bytes)
    totals = [CommTotal(k, a, c, b) for (k, a), (c, b) in acc.items()]
    return sorted(totals, key=lambda t: (-t.send_bytes, t.kind, t.axes))


def _columns(matrix: DeviceMatrix) -> int:
    """Ranks per drawn row: the last axis, or (past 64) its largest divisor up to 64."""
    last = matrix.shape[-1]
    if last <= 64:
        return last
    return max(d for d in range(1, 65) if last % d == 0)


def matrix_rows(matrix: DeviceMatrix) -> list[tuple[str, list[int]]]:
    """The ranks of `matrix` in row-major order, one drawn row per coordinate of the axes
    before the last (the last axis across; a last axis past 64 wraps on several rows), each
    with its label (``"dp=1, sp=0"``; ``"mp=64-127"`` where the last axis wraps)."""
    cols = _columns(matrix)
    ranks = list(matrix.rank_list)
    wraps = cols < matrix.shape[-1]
    rows = []
    for start in range(0, len(ranks), cols):
        coord = matrix.coord(ranks[start])
        parts = [f"{n}={c}" for n, c in zip(matrix.names[:-1], coord[:-1], strict=True)]
        if wraps:
            parts.append(f"{matrix.names[-1]}={coord[-1]}-{coord[-1] + cols - 1}")
        rows.append((", ".join(parts), ranks[start : start + cols]))
    return rows


def fmt_bytes(n: int) -> str:
    """`n` bytes for a reader: ``512 B``, ``1.5 KiB``, ``2.0 MiB``, ``3.2 GiB``."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
