"""Which collective each rank entered last, in a small file its launcher can read at any time.

Under ``shardwise run`` every worker gets ``SHARDWISE_COMM_TRACE=LOG_DIR/worker_<rank>.comm``.
When a collective times out, the launcher reads these files to find the ranks that never
arrived at it, and asks them for their Python stacks (see ``shardwise.launch.hang``).

- `open_trace`: called by `init()`; maps the file (`SIZE` bytes) into memory and registers
  ``faulthandler`` to write every thread's Python stack to stderr (the worker log) on SIGUSR1,
  and on a native crash (SIGSEGV, SIGABRT, ...: ``faulthandler.enable``), which the
  launcher's report then shows.
- `enter` / `leave`: around every collective of ``_collectives`` (and the pairwise bucket
  exchange): per group, how many collectives this rank entered and finished, the kind and the
  wall time of the last one entered. Each is one or two ``struct.pack_into`` on the mapping (no
  system call); without a trace file they return at once.
- `close_trace`: unmaps (`release()`).
- `mark_failing`: sets `FLAG_FAILING` (by `_exit`, when the script raises or calls
  ``sys.exit`` with a failure; after `close_trace` too): the launcher, which stops the other
  ranks when one fails, reads it with `read_failing` to tell a rank that had failed on its own
  and was still tearing down from one it stopped.

File layout (little endian): a 64-byte header (`HEADER`: magic, version, flags (`FLAG_STACKS`,
`FLAG_FAILING`), pid, index of the slot entered last), then `SLOTS` slots of `SLOT_SIZE` bytes,
one per group in the order first used (`SLOT`: entered, finished, wall time of the last entry,
kind; then the group's name and its global ranks as text, e.g. ``0-3`` or ``0,2``). Groups past
`SLOTS` are not traced.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.communication._init import Group

TRACE_ENV = "SHARDWISE_COMM_TRACE"
MAGIC = b"SWCT"
VERSION = 1
FLAG_STACKS = 1  # SIGUSR1 makes the worker write its Python stacks to its log
FLAG_FAILING = 2  # the script raised, or called sys.exit with a failure (`mark_failing`)
HEADER = struct.Struct("<4sHHIi")
HEADER_SIZE = 64
SLOT = struct.Struct("<QQd16s")
SLOT_SIZE = 256
NAME_AT, NAME_SIZE = 40, 96  # offsets inside a slot
RANKS_AT, RANKS_SIZE = 136, 120
SLOTS = 64
SIZE = HEADER_SIZE + SLOTS * SLOT_SIZE
_LAST = struct.Struct("<i")
_FINISHED = struct.Struct("<Q")
_FLAGS = struct.Struct("<H")
_FLAGS_AT = 6  # the header's flags


def trace_path(log_path: str | Path) -> Path:
    """The trace file next to a worker log: ``worker_3.log`` -> ``worker_3.comm``."""
    return Path(log_path).with_suffix(".comm")


def ranks_text(ranks: tuple[int, ...]) -> str:
    """Global ranks as runs: ``0-3``, ``0,2``, ``0-1,4-5``.

    Example:
        >>> ranks_text((0, 1, 2, 3)), ranks_text((0, 2))
        ('0-3', '0,2')
    """
    runs: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(runs)


@dataclass
class _Slot:
    offset: int
    entered: int = 0
    finished: int = 0


class _Trace:
    def __init__(self, path: str) -> None:
        with open(path, "w+b") as f:
            f.truncate(SIZE)
            self.mm = mmap.mmap(f.fileno(), SIZE)
        self.slots: dict[str, _Slot | None] = {}
        self.kinds: dict[str, bytes] = {}
        self.flags = 0
        self.pid = os.getpid()
        self.write_header(-1)

    def write_header(self, last: int) -> None:
        HEADER.pack_into(self.mm, 0, MAGIC, VERSION, self.flags, os.getpid(), last)

    def slot(self, g: Group) -> _Slot | None:
        index = len(self.slots)
        if index >= SLOTS:
            self.slots[g.name] = None
            return None
        slot = _Slot(HEADER_SIZE + index * SLOT_SIZE)
        name = g.name.encode()[:NAME_SIZE]
        ranks = ranks_text(g.ranks).encode()
        self.mm[slot.offset + NAME_AT : slot.offset + NAME_AT + len(name)] = name
        if len(ranks) <= RANKS_SIZE:  # else left empty: the launcher then asks every trace
            self.mm[slot.offset + RANKS_AT : slot.offset + RANKS_AT + len(ranks)] = ranks
        self.slots[g.name] = slot
        return slot


_active: _Trace | None = None
_opened: tuple[str, int] | None = None  # the path of the trace file last opened, and by which pid


def open_trace(path: str | None = None) -> bool:
    """Start tracing into `path` (default ``$SHARDWISE_COMM_TRACE``; nothing when unset).

    Returns:
        Whether a trace file is open.
    """
    global _active, _opened
    path = path or os.environ.get(TRACE_ENV)
    if not path:
        return False
    try:
        _active = _Trace(path)
    except OSError as e:
        print(f"shardwise: no collective trace at {path}: {e}", file=sys.stderr)
        return False
    _opened = (path, os.getpid())
    if hasattr(signal, "SIGUSR1") and sys.stderr is not None:
        try:
            if not faulthandler.is_enabled():  # a native crash (SIGSEGV) leaves a Python stack
                faulthandler.enable(file=sys.stderr, all_threads=True)
            chain = callable(signal.getsignal(signal.SIGUSR1))  # keep a handler already there
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=chain)
            _active.flags |= FLAG_STACKS
        except (ValueError, OSError, RuntimeError, AttributeError):  # stderr without a file
            pass
    _active.write_header(-1)
    return True


def close_trace() -> None:
    """Stop tracing (the file stays, with the last state)."""
    global _active
    if _active is not None:
        _active.mm.close()
        _active = None


def mark_failing() -> None:
    """Set `FLAG_FAILING` in this process's trace file (open, or closed by `release()`); nothing
    without one, or in a forked child of the process that opened it."""
    trace = _active
    if trace is not None and trace.pid == os.getpid():
        trace.flags |= FLAG_FAILING
        _FLAGS.pack_into(trace.mm, _FLAGS_AT, trace.flags)
        return
    if _opened is None or _opened[1] != os.getpid():
        return
    try:
        with open(_opened[0], "r+b") as f:
            magic, _version, flags, pid, _last = HEADER.unpack(f.read(HEADER.size))
            if magic == MAGIC and pid == os.getpid():
                f.seek(_FLAGS_AT)
                f.write(_FLAGS.pack(flags | FLAG_FAILING))
    except (OSError, struct.error):
        pass


def read_failing(path: str | Path, pid: int) -> bool | None:
    """Whether process `pid` has marked its trace file at `path` failing (`mark_failing`); None
    when there is no trace file of that process (it never called ``init()``).

    Example:
        >>> read_failing("/nonexistent/worker_0.comm", 42) is None
        True
    """
    try:
        with open(path, "rb") as f:
            magic, _version, flags, owner, _last = HEADER.unpack(f.read(HEADER.size))
    except (OSError, struct.error):
        return None
    if magic != MAGIC or owner != pid:
        return None
    return bool(flags & FLAG_FAILING)


Token = tuple[_Slot, int] | None


def enter(kind: str, g: Group) -> Token:
    """Record that this rank enters a collective of `kind` on `g`; pass the result to `leave`."""
    trace = _active
    if trace is None:
        return None
    slot = trace.slots[g.name] if g.name in trace.slots else trace.slot(g)
    if slot is None:
        return None
    code = trace.kinds.get(kind)
    if code is None:
        code = trace.kinds[kind] = kind.encode()[:16]
    slot.entered += 1
    SLOT.pack_into(trace.mm, slot.offset, slot.entered, slot.finished, time.time(), code)
    _LAST.pack_into(trace.mm, 12, (slot.offset - HEADER_SIZE) // SLOT_SIZE)
    return slot, slot.entered


def leave(token: Token) -> None:
    """Record that the collective `token` (from `enter`) finished on this rank."""
    if token is None or _active is None:
        return
    slot, seq = token
    if seq > slot.finished:
        slot.finished = seq
        _FINISHED.pack_into(_active.mm, slot.offset + 8, seq)
