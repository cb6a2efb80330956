"""What the launcher tells the user when the job ends: the root cause first.

- ``_logs``: `describe_returncode` (``exit code 1`` / ``signal SIGKILL``), `extract_traceback`
  and `log_excerpt` (a worker log's last traceback, or its last lines).
- `first_cause` / `lost_peer`: of ranks that failed at about the same time, the one that did
  not merely lose a peer (a traceback ending in "Connection closed by peer" follows another
  rank's exit).
- `group_failures`: failed ranks in the order they failed (the root cause's first), identical
  tracebacks collapsed.
- `RootCause`: the first failure of the job; it travels between launchers through the store
  as JSON (`RootCause.to_json` / `RootCause.from_json`).
- `format_failure_report` / `format_success_summary`: the text printed at the end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.launch._logs import (
    MAX_TRACEBACK_LINES,
    PEER_LOST,
    describe_returncode,
    log_excerpt,
)


@dataclass(frozen=True)
class WorkerExit:
    """How one local worker ended.

    Attributes:
        rank: global rank.
        local_rank: rank on this node.
        pid: process id.
        returncode: ``Popen.returncode`` (negative: killed by that signal).
        ended: wall-clock time (``time.time()``) the launcher saw it exit.
        stopped: True when the launcher had asked it to stop (it is not a root cause).
        log_path: its ``worker_<rank>.log``.
        ended_by_launcher: it had failed on its own (its log ends in a traceback), and the
            signal in `returncode` is the launcher's (SIGTERM, SIGKILL, or the SIGUSR1 asking
            for its stack) that ended its teardown, not its failure.
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    ended: float
    stopped: bool
    log_path: str
    ended_by_launcher: bool = False

    @property
    def failed(self) -> bool:
        """Ended badly on its own (non-zero code or a signal the launcher did not send)."""
        return self.returncode != 0 and not self.stopped


@dataclass(frozen=True)
class RootCause:
    """The first failure of a job, as every launcher reports it.

    Attributes:
        reason: one line, e.g. ``rank 1 exited with code 1``.
        node_rank: node where it happened.
        host: that node's host name.
        rank: the failed worker's rank, or None when no worker failed (a launcher was
            interrupted, or lost).
        lines: traceback tail (or last log lines) of that worker.
        log: path of that worker's log, on its node.
        stuck: when the worker failed in a collective some ranks never arrived at (see
            `hang.explain`): where each of those ranks is, shown before the worker's lines.
        traceback: whether `lines` are a traceback (False: the log's last lines, shown under
            a line that says so, on every node).
    """

    reason: str
    node_rank: int
    host: str
    rank: int | None = None
    lines: tuple[str, ...] = ()
    log: str = ""
    stuck: tuple[str, ...] = ()
    traceback: bool = True

    def to_json(self) -> str:
        """Serialize for the store."""
        return json.dumps(
            {
                "reason": self.reason,
                "node_rank": self.node_rank,
                "host": self.host,
                "rank": self.rank,
                "lines": list(self.lines),
                "log": self.log,
                "stuck": list(self.stuck),
                "traceback": self.traceback,
            }
        )

    @staticmethod
    def from_json(text: str | bytes) -> RootCause:
        """Parse what `to_json` wrote (a garbled value becomes a readable reason)."""
        try:
            d = json.loads(text)
            return RootCause(
                reason=str(d["reason"]),
                node_rank=int(d["node_rank"]),
                host=str(d["host"]),
                rank=None if d.get("rank") is None else int(d["rank"]),
                lines=tuple(str(x) for x in d.get("lines", [])),
                log=str(d.get("log", "")),
                stuck=tuple(str(x) for x in d.get("stuck", [])),
                traceback=bool(d.get("traceback", True)),
            )
        except (ValueError, KeyError, TypeError):
            return RootCause(
                reason=f"another launcher reported a failure: {text!r}", node_rank=-1, host="?"
            )


@dataclass(frozen=True)
class FailureGroup:
    """Ranks that failed with the same output (first failure first)."""

    exits: tuple[WorkerExit, ...]
    lines: tuple[str, ...]
    is_traceback: bool

    @property
    def ranks(self) -> list[int]:
        """The ranks of the group, in the order they failed."""
        return [e.rank for e in self.exits]


def first_cause(failures: Sequence[WorkerExit]) -> WorkerExit:
    """The root cause among workers that failed at about the same time: the first (by exit
    time) whose log does not end in a lost peer (`PEER_LOST`: it failed because another rank
    left, e.g. one that called ``sys.exit(3)`` and closed its connections as it went), else the
    first.

    Example:
        >>> e = WorkerExit(1, 1, 42, 3, 0.0, False, "/nonexistent/worker_1.log")
        >>> first_cause([e]).rank
        1
    """
    ordered = sorted(failures, key=lambda e: (e.ended, e.rank))
    return next((e for e in ordered if not lost_peer(e)), ordered[0])


def lost_peer(e: WorkerExit) -> bool:
    """Whether worker `e`'s log ends in a lost peer (`PEER_LOST`): it failed because another
    rank went away.

    Example:
        >>> lost_peer(WorkerExit(1, 1, 42, 1, 0.0, False, "/nonexistent/worker_1.log"))
        False
    """
    lines, _ = log_excerpt(e.log_path)
    return any(PEER_LOST.search(line) for line in lines)


def group_failures(
    exits: Sequence[WorkerExit], max_lines: int = MAX_TRACEBACK_LINES, first: int | None = None
) -> list[FailureGroup]:
    """Failed workers (not those the launcher stopped) grouped by identical log excerpt.

    Args:
        exits: how the local workers ended.
        max_lines: traceback cap.
        first: the rank named as the root cause (its group comes first), if local.

    Returns:
        Groups ordered by their first failure (`first`'s group first); each group's exits
        ordered by time.

    Example:
        >>> group_failures([])
        []
    """
    groups: dict[tuple[str, ...], list[WorkerExit]] = {}
    kinds: dict[tuple[str, ...], bool] = {}
    failed = (e for e in exits if e.failed)
    for e in sorted(failed, key=lambda e: (e.rank != first, e.ended, e.rank)):
        lines, is_tb = log_excerpt(e.log_path, max_lines)
        key = tuple(lines) if is_tb else (describe_returncode(e.returncode), *lines)
        groups.setdefault(key, []).append(e)
        kinds[key] = is_tb
    return [
        FailureGroup(tuple(g), key if kinds[key] else key[1:], kinds[key])
        for key, g in groups.items()
    ]


def format_ranks(ranks: Sequence[int]) -> str:
    """``0-3`` for consecutive ranks, ``1, 3`` otherwise.

    Example:
        >>> format_ranks([0, 1, 2, 3]), format_ranks([3, 1])
        ('0-3', '1, 3')
    """
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(str(r) for r in ordered)


def ranks_label(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0-3`` (see `format_ranks`).

    Example:
        >>> ranks_label([2]), ranks_label([0, 1])
        ('rank 2', 'ranks 0, 1')
    """
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


def _indent(lines: Sequence[str]) -> list[str]:
    return [f"  {line}" for line in lines]


def _group_text(group: FailureGroup, first: bool) -> list[str]:
    head = group.exits[0]
    also = "" if first else "also "
    out: list[str] = []
    if len(group.exits) > 1:
        ranks = ", ".join(map(str, group.ranks))
        same = "with the same error" if group.is_traceback else "the same way"
        out.append(f"ranks {ranks} {also}failed {same}:")
    elif not first and head.ended_by_launcher:
        name = describe_returncode(head.returncode).removeprefix("signal ")
        out.append(f"rank {head.rank} also failed (pid {head.pid}; the launcher's {name} "
                   "ended its teardown):")  # fmt: skip
    elif not first:
        out.append(
            f"rank {head.rank} also failed with {describe_returncode(head.returncode)} "
            f"(pid {head.pid}):"
        )
    if not group.is_traceback:
        out.append(f"no traceback in {Path(head.log_path).name}; its last lines:")
    out += _indent(group.lines)
    return out


def format_failure_report(
    root: RootCause,
    exits: Sequence[WorkerExit],
    node_rank: int,
    scheduler_log: str,
) -> str:
    """The failure report: root cause first, then other failures, stopped ranks, and logs.

    Args:
        root: the job's first failure (local, or read from the store when another node failed).
        exits: how this node's workers ended.
        node_rank: this node.
        scheduler_log: path of this launcher's scheduler log.

    Returns:
        Text for stderr, several lines, no trailing newline.

    Example:
        >>> print(format_failure_report(RootCause("launcher got SIGINT", 0, "h"), [], 0, "s.log"))
        shardwise run: job failed: launcher got SIGINT
        logs: s.log
    """
    local_root = root.node_rank == node_rank and root.rank is not None
    groups = group_failures(exits, first=root.rank if local_root else None)
    where = "" if root.node_rank == node_rank else f" on node {root.node_rank} ({root.host})"
    out = [f"shardwise run: job failed{where}: {root.reason}", *root.stuck]
    if local_root and groups:
        head = groups[0].exits[0]
        if root.stuck:  # (the first of the ranks that waited, whoever failed beside it)
            out.append(
                f"rank {head.rank} failed first with {describe_returncode(head.returncode)} "
                f"(pid {head.pid}):"
            )
        out += _group_text(groups[0], first=True)
        groups = groups[1:]
    elif root.lines:
        if root.stuck and root.rank is not None:
            out.append(f"rank {root.rank} failed first:")
        if not root.traceback:  # (as `_group_text` says it of a local rank's lines)
            out.append(f"no traceback in {Path(root.log).name}; its last lines:")
        out += _indent(root.lines)
    for group in groups:
        out += _group_text(group, first=False)
    stopped = [e for e in exits if e.stopped]
    if stopped:
        how = sorted({describe_returncode(e.returncode).removeprefix("signal ") for e in stopped})
        label = ranks_label([e.rank for e in stopped])
        out.append(f"stopped by the launcher: {label} (ended by {', '.join(how)})")
    left = [e.rank for e in exits if e.returncode == 0 and not e.stopped]
    if left:  # (one that left early leaves the others waiting: in init(), or a collective)
        out.append(
            f"exited with code 0: {ranks_label(left)} (a rank that leaves early leaves the "
            "others waiting in init() or at their next collective)"
        )
    logs = [scheduler_log]
    if root.log:
        logs.insert(0, root.log + ("" if root.node_rank == node_rank else f" (on {root.host})"))
    out.append("logs: " + ", ".join(logs))
    return "\n".join(out)


def format_success_summary(exits: Sequence[WorkerExit], seconds: float, log_dir: str) -> str:
    """The one-paragraph summary printed by ``--join True`` when every local worker succeeded.

    Example:
        >>> print(format_success_summary([], 1.0, "/tmp/logs"))
        shardwise run: job finished: 0 workers exited with code 0 in 1.0 s
        logs: /tmp/logs/scheduler.log, /tmp/logs/worker_<rank>.log
    """
    ranks = [e.rank for e in exits]
    who = ranks_label(ranks) if ranks else "0 workers"
    return (
        f"shardwise run: job finished: {who} exited with code 0 in {seconds:.1f} s\n"
        f"logs: {log_dir}/scheduler.log, {log_dir}/worker_<rank>.log"
    )


def worker_root_cause(failed: WorkerExit, node_rank: int, host: str) -> RootCause:
    """The `RootCause` of a local worker that failed first.

    Args:
        failed: the worker's exit.
        node_rank: this node.
        host: this node's host name.

    Returns:
        A `RootCause` carrying the worker's traceback tail (or last log lines).

    Example:
        >>> e = WorkerExit(1, 1, 42, -9, 0.0, False, "/nonexistent/worker_1.log")
        >>> worker_root_cause(e, 0, "h").reason
        'rank 1 failed first with signal SIGKILL (pid 42)'
    """
    lines, is_traceback = log_excerpt(failed.log_path)
    return RootCause(
        reason=(
            f"rank {failed.rank} failed first with {describe_returncode(failed.returncode)} "
            f"(pid {failed.pid})"
        ),
        node_rank=node_rank,
        host=host,
        rank=failed.rank,
        lines=tuple(lines),
        log=failed.log_path,
        traceback=is_traceback,
    )
