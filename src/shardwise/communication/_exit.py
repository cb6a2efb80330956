"""A clean process exit for every script that called `init()`, with or without `release()`.

Left to interpreter shutdown, torch's gloo process group is torn down while its worker threads
may still drop Python objects of the last collectives; such a thread cannot take the GIL any
more and the process aborts ("terminate called without an active exception", SIGABRT), so the
launcher reports a job that did all its work as failed.

- `install`: called by `init()`; registers `_at_exit` with `atexit` (once per process),
  chains `sys.excepthook` so that an uncaught exception marks the exit as failing, and wraps
  ``sys.exit`` to remember the status the main thread called it with (an uncaught
  ``SystemExit`` reaches no hook; a ``raise SystemExit(3)`` written out is not seen; another
  thread's ``sys.exit`` ends only that thread and is not remembered; a ``SystemExit`` that the
  main thread catches and goes on from still counts, as nothing tells the two apart). Both
  mark the worker's trace file failing (`_trace.mark_failing`), for the launcher.
- `_at_exit`: a script that ended normally (or through ``sys.exit()`` / ``sys.exit(0)``)
  leaves the job as `release()` does: a barrier through the rendezvous store, bounded by
  `exit_wait` so that a rank never waits long for peers that are still busy or gone, then the
  process groups are destroyed while the interpreter is still whole. A script that failed
  (`script_failed`: it raised, or called ``sys.exit`` with a non-zero code or a message) is
  left alone but for a `RAISED_PAUSE_S` pause in which torch's worker threads finish with the
  last collectives: it waits for nobody, its traceback (or message) is its last output, and it
  ends before its peers notice.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

from shardwise.communication import _trace

EXIT_WAIT_S = 10.0
RAISED_PAUSE_S = 0.05

_installed_pid: int | None = None  # the process that registered the hook (a fork re-registers)
_raised = False  # an uncaught exception reached sys.excepthook in this process
_exit_status: object = None  # the last status the main thread called sys.exit with


def exit_wait(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long the exit barrier waits for the other ranks: `EXIT_WAIT_S`, at most `timeout`.

    Example:
        >>> exit_wait(datetime.timedelta(seconds=3)).total_seconds()
        3.0
    """
    return min(timeout, datetime.timedelta(seconds=EXIT_WAIT_S))


def install() -> None:
    """Register the exit hook and the excepthook wrapper (idempotent, per process)."""
    global _installed_pid, _raised, _exit_status
    if _installed_pid == os.getpid():
        return
    _installed_pid, _raised, _exit_status = os.getpid(), False, None
    previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        global _raised
        _raised = True
        _trace.mark_failing()  # (before the traceback: the launcher may stop it at any time)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    sys.exit = _recording_exit(sys.exit)
    atexit.register(_at_exit)


_Status = str | int | None


def _recording_exit(previous: Callable[[_Status], NoReturn]) -> Callable[..., NoReturn]:
    def exit(status: _Status = None, /) -> NoReturn:
        global _exit_status
        if threading.current_thread() is threading.main_thread():  # (another ends its thread)
            _exit_status = status
            if script_failed():
                _trace.mark_failing()
        previous(status)

    exit.__doc__ = previous.__doc__
    return exit


def script_raised() -> bool:
    """Whether an uncaught exception ended (or is ending) this process's script: seen by the
    wrapped excepthook, or (a hook installed later replaced it, e.g. rich's or IPython's) by
    ``sys.last_value``, which the interpreter sets before exit handlers run."""
    return _raised or getattr(sys, "last_value", None) is not None


def script_failed() -> bool:
    """Whether this process's script is ending in failure: it raised (`script_raised`), or
    its main thread called ``sys.exit`` with a non-zero code or a message (Python exits 1 with
    that message then); ``sys.exit()``, ``sys.exit(0)`` and another thread's ``sys.exit`` are a
    normal end."""
    status = _exit_status
    failed_exit = status is not None and (not isinstance(status, int) or status != 0)
    return failed_exit or script_raised()


def _at_exit() -> None:
    if _installed_pid != os.getpid():
        return
    if script_failed():
        _trace.mark_failing()  # (an excepthook installed after init() replaced the marking one)
        # A failing script keeps torch's own teardown: destroying its groups here would close
        # its connections while it is still alive, and the peers waiting on it would fail (and
        # could exit) before it does. A short pause (the GIL released) lets torch's worker
        # threads drop the last collectives' tensors while the interpreter can still take them.
        time.sleep(RAISED_PAUSE_S)
        return
    from shardwise.communication._init import leave_at_exit

    try:
        leave_at_exit()
    except Exception as e:  # never turn a finished script into a failed one
        print(f"shardwise: leaving the job at exit: {type(e).__name__}: {e}", file=sys.stderr)
