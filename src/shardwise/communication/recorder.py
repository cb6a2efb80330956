"""Communication accounting: what every collective shardwise issues costs.

`CommRecorder` is a context manager; while one is active, `record()` (called by every
collective in `_collectives.py` and by `_exchange.py`'s point-to-point `exchange`) appends a
`CommRecord`: kind, group ranks, dtype, element count, bytes sent per rank by the ring/pairwise
bound of that collective (`bytes_bound`), wall time, and whether it ran in the forward or the
backward pass. Recorders nest; each sees every record.

Example:
    >>> with CommRecorder() as rec:
    ...     y = sw.ops.AllReduce()(x)
    >>> rec.count("AllReduce"), rec.total_bytes()
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType

import torch


def bytes_bound(kind: str, nbytes: int, group_size: int) -> int:
    """Bytes each rank must send for one collective, by the ring / pairwise bound.

    Args:
        kind: the collective's name (``AllReduce``, ``AllGather``, ...).
        nbytes: bytes of the *input* on one rank (for ``AllGather`` the local shard; for
            ``ReduceScatter`` the full, unscattered tensor; for ``NeighborExchange`` the bytes
            this rank sends to other ranks).
        group_size: ranks in the group.

    Returns:
        AllReduce 2(N-1)/N·S, AllGather (N-1)·S, ReduceScatter (N-1)/N·S, AlltoAll (N-1)/N·S,
        Broadcast and Reduce (N-1)/N·S (the mean over ranks: in a pipelined chain every rank but
        one forwards S once), point-to-point exchanges: what is sent. A 1-rank group sends
        nothing.

    Example:
        >>> bytes_bound("AllReduce", 1024, 4)
        1536
    """
    n = group_size
    if n <= 1:
        return 0
    if kind == "AllReduce":
        return 2 * (n - 1) * nbytes // n
    if kind == "AllGather":
        return (n - 1) * nbytes
    if kind in ("ReduceScatter", "AlltoAll"):
        return (n - 1) * nbytes // n
    if kind in ("Broadcast", "Reduce"):
        # a pipelined chain: N-1 ranks forward S each, (N-1)/N S per rank on average
        return (n - 1) * nbytes // n
    if kind in ("NeighborExchange", "NeighborExchangeV2"):
        return nbytes
    raise ValueError(f"bytes_bound: unknown collective kind {kind!r}")


@dataclass(frozen=True)
class CommRecord:
    """One collective call.

    Attributes:
        kind: ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``Broadcast``, ``AlltoAll``,
            ``NeighborExchange``, ``NeighborExchangeV2`` or ``Reduce``.
        group: the global ranks of the group.
        dtype: element type.
        numel: elements of the input on one rank.
        bytes_sent: bytes each rank sends (the bound of `bytes_bound`; for point-to-point
            exchanges the largest amount any rank sends).
        seconds: wall time of the call on this process.
        phase: ``"forward"``, ``"backward"`` or ``"step"`` (optimizer parallel at the step).
        end: `timer()` when the call returned (0.0: not timed).
        label: what it moves (``label()``, e.g. an optimizer-parallel bucket), or "".
    """

    kind: str
    group: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    bytes_sent: int
    seconds: float
    phase: str = "forward"
    end: float = 0.0
    label: str = ""

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.kind}({self.phase}) group={list(self.group)} {dt}[{self.numel}] "
            f"sent={self.bytes_sent}B {self.seconds * 1e3:.3f}ms"
        )


@dataclass(eq=False)
class CommRecorder:
    """Collects a `CommRecord` for every collective issued while it is active.

    Example:
        >>> with CommRecorder() as rec:
        ...     ...
        >>> print(rec.summary())
    """

    records: list[CommRecord] = field(default_factory=list)
    marks: list[tuple[str, float]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def __enter__(self) -> CommRecorder:
        _active.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _active.remove(self)

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of records, optionally of one kind and/or phase."""
        return len(self.select(kind, phase))

    def select(self, kind: str | None = None, phase: str | None = None) -> list[CommRecord]:
        """The records of one kind and/or phase (all when both are None)."""
        return [
            r
            for r in self.records
            if (kind is None or r.kind == kind) and (phase is None or r.phase == phase)
        ]

    def total_bytes(self, kind: str | None = None) -> int:
        """Bytes sent per rank, summed over the (selected) records."""
        return sum(r.bytes_sent for r in self.select(kind))

    def kinds(self) -> Counter[tuple[str, str, tuple[int, ...]]]:
        """Counts by (kind, phase, group): the shape tests assert on."""
        return Counter((r.kind, r.phase, r.group) for r in self.records)

    def timeline(self) -> str:
        """Every collective and compute mark in time order, in ms since the recorder started:
        when each (labelled) collective ran relative to forward, backward and the optimizer step
        (the marks `mark()` sets), e.g. an optimizer-parallel bucket's ReduceScatter starting
        while later gradients are still being computed.

        Example:
            >>> print(rec.timeline())
        """
        events: list[tuple[float, str]] = [(t, f"{'':>8}  -- {name}") for name, t in self.marks]
        for r in self.records:
            start = r.end - r.seconds
            label = f" {r.label}" if r.label else ""
            line = (
                f"{(r.end - self.t0) * 1e3:8.2f}  {r.kind}({r.phase}){label} "
                f"group={list(r.group)} {r.bytes_sent} B"
            )
            events.append((start, line))
        rows = ["start ms    end ms  event"]
        for t, line in sorted(events, key=lambda e: e[0]):
            rows.append(f"{(t - self.t0) * 1e3:8.2f}  {line}")
        return "\n".join(rows)

    def summary(self) -> str:
        """A table: one line per (kind, phase, group) with count, bytes and time."""
        rows = ["kind               phase     group                 calls   bytes/rank     ms"]
        for (kind, phase, group), n in sorted(self.kinds().items()):
            sel = [r for r in self.records if (r.kind, r.phase, r.group) == (kind, phase, group)]
            nbytes = sum(r.bytes_sent for r in sel)
            ms = sum(r.seconds for r in sel) * 1e3
            g = str(list(group))
            rows.append(f"{kind:<18} {phase:<9} {g:<21} {n:>5} {nbytes:>12} {ms:>7.2f}")
        return "\n".join(rows)


_active: list[CommRecorder] = []
_phase: list[str] = ["forward"]
_label: list[str] = [""]


def recording() -> bool:
    """Whether any recorder is active (collectives skip the bookkeeping otherwise)."""
    return bool(_active)


def record(
    kind: str,
    group: tuple[int, ...],
    dtype: torch.dtype,
    numel: int,
    bytes_sent: int,
    seconds: float,
) -> None:
    """Append one record to every active recorder."""
    end = time.perf_counter()
    rec = CommRecord(kind, group, dtype, numel, bytes_sent, seconds, _phase[-1], end, _label[-1])
    for r in _active:
        r.records.append(rec)


@contextmanager
def label(name: str) -> Iterator[None]:
    """Label the collectives issued inside (shown by `CommRecorder.timeline`)."""
    _label.append(name)
    try:
        yield
    finally:
        _label.pop()


def current() -> tuple[str, str]:
    """The phase and label collectives issued now are recorded under."""
    return _phase[-1], _label[-1]


def mark(name: str) -> None:
    """Note a compute event (``"forward"``, ``"backward done"`` ...) for the timelines."""
    if _active:
        now = time.perf_counter()
        for r in _active:
            r.marks.append((name, now))


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark collectives issued inside as belonging to `name` (``"backward"`` in grad rules)."""
    _phase.append(name)
    try:
        yield
    finally:
        _phase.pop()


def timer() -> float:
    """The clock used for `CommRecord.seconds`; waits for queued CUDA work first."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def start() -> float:
    """A collective's start time: `timer()` while recording, else 0.0 (no clock, no sync)."""
    return timer() if _active else 0.0
