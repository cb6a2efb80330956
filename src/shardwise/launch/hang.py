"""A collective that failed because some ranks never arrived: name them, and show where they are.

Each worker traces the collectives it enters into ``LOG_DIR/worker_<rank>.comm`` (written by
``shardwise.communication._trace``; the layout is described there). When a worker fails inside
a collective, the launcher, before it stops the others:

1. `read_trace`: reads the trace of every local worker;
2. `find_stragglers`: compares, for the group of the failed collective, how many collectives
   each member entered and the kind of its last one: the members behind the others, or inside
   another kind of collective, never arrived (only when the failed rank had waited in it for
   `min_wait` seconds: an immediate error of the collective blames nobody);
3. `collect_stacks`: sends SIGUSR1 to those still running (their ``faulthandler`` writes every
   thread's Python stack to their log) and reads the stacks back; for those already gone (or
   gone while the launcher waited for their stacks), the last traceback of their log;
4. `explain`: puts it together as the job's `RootCause`: its reason names the ranks that never
   arrived and the collective, its `stuck` lines hold where each one is.

A worker that failed in ``init()`` waiting for the other ranks (torch's store timeout) has no
trace yet (``init()`` opens it last): the local workers still running without a trace never
reached ``init()`` (`_before_init`), and the root cause names them.

Only this node's workers are read: a rank on another node is neither blamed nor cleared. With
NCCL a collective returns once queued, so the collective a rank entered last stands for the one
it waits in.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shardwise._envvars import comm_timeout_s
from shardwise.communication._trace import (
    FLAG_STACKS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NAME_AT,
    NAME_SIZE,
    RANKS_AT,
    RANKS_SIZE,
    SIZE,
    SLOT,
    SLOT_SIZE,
    SLOTS,
    trace_path,
)
from shardwise.launch._logs import log_excerpt
from shardwise.launch.report import RootCause, WorkerExit, ranks_label
from shardwise.launch.supervisor import Worker, has_exited

STACK_WAIT_S = 2.0
MIN_WAIT_S = 1.0
STACK_HEADER = "(most recent call first):"
MAX_STACK_LINES = 30


@dataclass(frozen=True)
class GroupTrace:
    """One group's line of a worker's trace."""

    name: str
    ranks: tuple[int, ...] | None  # None: too many to write down
    entered: int
    finished: int
    entered_at: float
    kind: str

    def describe(self) -> str:
        """``AllReduce #12 of world_group`` and whether it finished."""
        state = "finished" if self.finished >= self.entered else "still inside"
        return f"{self.kind} #{self.entered} of {self.name} ({state})"


@dataclass(frozen=True)
class Trace:
    """A worker's trace: its pid, whether SIGUSR1 dumps its stacks, its groups."""

    pid: int
    dumps_stacks: bool
    last: str | None
    groups: dict[str, GroupTrace]


@dataclass(frozen=True)
class Stragglers:
    """The collective some members of `group` never arrived at."""

    group: str
    members: tuple[int, ...]
    kind: str
    seq: int
    waiting: tuple[int, ...]
    missing: tuple[int, ...]

    def target(self) -> str:
        """``AllReduce #12 of group world_group (ranks 0-3)``."""
        return f"{self.kind} #{self.seq} of group {self.group} ({ranks_label(list(self.members))})"


def _parse_ranks(text: str) -> tuple[int, ...] | None:
    if not text:
        return None
    out: list[int] = []
    for run in text.split(","):
        first, _, last = run.partition("-")
        out += range(int(first), int(last or first) + 1)
    return tuple(out)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def read_trace(path: str | Path) -> Trace | None:
    """Parse a worker's trace file; None when it is missing or not a trace."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    magic, _version, flags, pid, last = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return None
    groups: dict[str, GroupTrace] = {}
    last_name = None
    for index in range(SLOTS):
        at = HEADER_SIZE + index * SLOT_SIZE
        name = _text(data[at + NAME_AT : at + NAME_AT + NAME_SIZE])
        if not name:
            break
        entered, finished, when, kind = SLOT.unpack_from(data, at)
        try:
            ranks = _parse_ranks(_text(data[at + RANKS_AT : at + RANKS_AT + RANKS_SIZE]))
        except ValueError:
            ranks = None
        groups[name] = GroupTrace(name, ranks, entered, finished, when, _text(kind))
        if index == last:
            last_name = name
    return Trace(pid, bool(flags & FLAG_STACKS), last_name, groups)


def find_stragglers(
    failed: int, traces: Mapping[int, Trace], failed_at: float | None = None, min_wait: float = 0.0
) -> Stragglers | None:
    """The members of the failed rank's collective that never arrived at it, if any.

    The failed rank's collective (`_failed_collective`) names the group.
    Of its members, those that entered the most collectives of it and agree on the most
    common kind arrived; the others (behind, or in another kind of collective) never did.

    Args:
        failed: the rank that failed.
        traces: rank -> its trace (this node's workers).
        failed_at: wall time of the failure; with `min_wait`, a failure less than `min_wait`
            seconds after the rank entered its collective is not a wait for late ranks (an
            error of the collective itself, while the others were on their way): None then.
        min_wait: see `failed_at`.
    """
    mine = traces.get(failed)
    where = _failed_collective(mine) if mine else None
    if where is None:
        return None
    if failed_at is not None and failed_at - where.entered_at < min_wait:
        return None
    members = where.ranks or tuple(sorted(r for r, t in traces.items() if where.name in t.groups))
    known = {r: traces[r].groups.get(where.name) for r in members if r in traces}
    counts = {r: g.entered if g else 0 for r, g in known.items()}
    top = max(counts.values())
    if where.entered <= where.finished and counts[failed] < top:
        return None  # (NCCL fallback) the failed rank is behind: its own error is the cause
    kinds = Counter(g.kind for r, g in known.items() if g and counts[r] == top)
    kind = kinds.most_common(1)[0][0]
    if kinds[where.kind] == kinds[kind] and counts[failed] == top:
        kind = where.kind  # a tie: the failed rank's view
    missing = tuple(r for r, g in known.items() if counts[r] < top or (g and g.kind != kind))
    if not missing:
        return None
    waiting = tuple(r for r in known if r not in missing)
    return Stragglers(where.name, members, kind, top, waiting, missing)


def _failed_collective(mine: Trace) -> GroupTrace | None:
    """The collective the failed rank was in: the one it entered last when that one is
    unfinished, else its oldest unfinished one (an earlier prefetch on another group), else the
    one it entered last (NCCL returns from a collective once it is queued, so a rank waiting on
    the device shows no unfinished collective)."""
    last = mine.groups.get(mine.last) if mine.last is not None else None
    if last is not None and last.entered > last.finished:
        return last
    inside = [g for g in mine.groups.values() if g.entered > g.finished]
    if inside:
        return min(inside, key=lambda g: g.entered_at)
    return last


def min_wait(env: Mapping[str, str] = os.environ) -> float:
    """How long a rank must have waited in a collective before late ranks are blamed:
    `MIN_WAIT_S`, or half of ``$SHARDWISE_COMM_TIMEOUT`` (the workers inherit it) if shorter.

    Example:
        >>> min_wait({"SHARDWISE_COMM_TIMEOUT": "0.5"})
        0.25
    """
    timeout = comm_timeout_s(env)
    return min(MIN_WAIT_S, timeout / 2)


def collect_stacks(pids: Mapping[int, tuple[int, Path]]) -> dict[int, list[str]]:
    """Ask running workers for their Python stacks (SIGUSR1) and read them from their logs.

    Args:
        pids: rank -> (pid, log path) of workers whose trace says SIGUSR1 dumps their stacks.

    Returns:
        rank -> the stack lines written after the signal (``[]`` when none came in time).
    """
    sizes: dict[int, int] = {}
    for rank, (pid, log) in pids.items():
        try:
            sizes[rank] = log.stat().st_size
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
    stacks: dict[int, list[str]] = {}
    deadline = time.monotonic() + STACK_WAIT_S
    while sizes and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(sizes):
            text = _read_from(pids[rank][1], sizes[rank])
            if STACK_HEADER in text and text.endswith("\n"):
                time.sleep(0.05)  # the other threads' stacks follow at once
                stacks[rank] = _stack_lines(_read_from(pids[rank][1], sizes[rank]))
                del sizes[rank]
    return {**{r: [] for r in sizes}, **stacks}


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _stack_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if STACK_HEADER in line), 0)
    lines = [line for line in lines[start:] if line]
    if len(lines) > MAX_STACK_LINES:
        lines = [*lines[: MAX_STACK_LINES - 1], f"... ({len(lines) - MAX_STACK_LINES + 1} more)"]
    return lines


def _age(entered_at: float) -> str:
    return f"{max(0.0, time.time() - entered_at):.1f} s ago"


def explain(root: RootCause, failed: WorkerExit, workers: Sequence[Worker]) -> RootCause:
    """`root` (the failed worker's own root cause), rewritten when it failed inside a
    collective that some local ranks never arrived at (see the module docstring).

    Args:
        root: the failed worker's `RootCause`.
        failed: the failed worker's exit.
        workers: this node's workers (those still running have no return code); those asked
            for their stacks get `Worker.stack_requested` (that SIGUSR1 is not their failure).

    Returns:
        `root` unchanged, or a copy whose reason names the ranks that never arrived and whose
        `stuck` lines say where each one is.
    """
    logs = {w.rank: w.log_path for w in workers}
    running = {w.rank: w.pid for w in workers if w.returncode is None}
    traces = {r: t for r, log in logs.items() if (t := read_trace(trace_path(log))) is not None}
    mine = traces.get(failed.rank)
    if mine is None:
        return _before_init(root, failed, workers, traces)
    found = find_stragglers(failed.rank, traces, failed.ended, min_wait())
    if found is None:
        return root
    asked = {r: (running[r], logs[r]) for r in found.missing if r in running}
    # only the process that registered the handler (not a parent)
    asked = {r: v for r, v in asked.items() if traces[r].dumps_stacks and traces[r].pid == v[0]}
    for w in workers:
        w.stack_requested = w.stack_requested or w.rank in asked
    stacks = collect_stacks(asked)
    # (a rank may have failed on its own meanwhile: it did not owe a stack)
    running = {r: pid for r, pid in running.items() if not has_exited(pid)}
    lines: list[str] = []
    for rank in found.missing:
        lines += _straggler_lines(rank, found, traces[rank], rank in running, stacks.get(rank))
        if rank not in running and rank != failed.rank:  # (the failed rank's lines follow)
            lines.append("  the end of its log:")
            lines += [f"    {line}" for line in log_excerpt(logs[rank])[0]]
    waited = failed.ended - mine.groups[found.group].entered_at
    reason = (
        f"{ranks_label(list(found.missing))} never arrived at {found.target()}; "
        f"{ranks_label(list(found.waiting))} waited in it until rank {failed.rank} failed "
        f"after {waited:.1f} s"
    )
    return replace(root, reason=reason, stuck=tuple(lines))


_INIT_WAIT = re.compile(r"DistStoreError|[Tt]imeout|timed out")
"""A failure of ``init()`` (no trace yet) that waited for other ranks."""
_IN_INIT = re.compile(r'shardwise[/\\]communication[/\\]_init\.py", line \d+, in init$')


def _timed_out_in_init(lines: Sequence[str]) -> bool:
    """Whether a log's last lines hold a traceback through shardwise's ``init()`` whose
    exception (a line at column 0, not a frame or source line) is a store or connection
    timeout."""
    if not any(_IN_INIT.search(line.rstrip()) for line in lines):
        return False
    return any(_INIT_WAIT.search(line) for line in lines if line[:1] not in (" ", "\t", ""))


def _before_init(
    root: RootCause, failed: WorkerExit, workers: Sequence[Worker], traces: Mapping[int, Trace]
) -> RootCause:
    """`root`, or when the failed worker timed out inside shardwise's ``init()`` waiting for
    other ranks (its traceback passes through ``init``), a copy naming the local workers still
    running that have no trace of their own either: they had not finished ``init()`` (the
    trace is made at its end), most often never reached it."""
    whole = log_excerpt(failed.log_path, max_lines=100_000)[0]  # (untrimmed: init's frame)
    if not _timed_out_in_init(whole):
        return root
    late = [
        w
        for w in workers
        if w.rank != failed.rank
        and w.returncode is None
        and not has_exited(w.pid)
        and (w.rank not in traces or traces[w.rank].pid != w.pid)
    ]
    if not late:
        return root
    label = ranks_label([w.rank for w in late])
    reason = (
        f"{label} never finished init() (still running: in the script before it, or stuck in "
        f"it); rank {failed.rank} failed first waiting for {'it' if len(late) == 1 else 'them'} "
        "in init()"
    )
    stuck = [
        f"rank {w.rank} (pid {w.pid}, still running): had not finished init() (no collective "
        f"trace, {trace_path(w.log_path).name}); no Python stack: init() registers it; see "
        f"{w.log_path.name}"
        for w in late
    ]
    return replace(root, reason=reason, stuck=tuple(stuck))


def _straggler_lines(
    rank: int, found: Stragglers, trace: Trace, running: bool, stack: list[str] | None
) -> list[str]:
    own = trace.groups.get(found.group)
    if own is not None and own.entered == found.seq:
        there = f"it is in {own.kind} #{own.entered} of {found.group} instead"
    else:
        count = own.entered if own else 0
        there = f"it has entered only {count} collective(s) of {found.group}"
    last = trace.groups.get(trace.last) if trace.last else None
    entered = f"{last.describe()}, entered {_age(last.entered_at)}" if last else "none"
    state = "still running" if running else "already exited"
    out = [f"rank {rank} (pid {trace.pid}, {state}): {there}; last collective entered: {entered}"]
    if running:
        if stack:
            out.append("  its Python stack:")
            out += [f"    {line}" for line in stack]
        else:
            out.append(f"  (it did not write its stack within {STACK_WAIT_S:g} s)")
    return out
