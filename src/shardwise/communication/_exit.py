"""A clean process exit for every script that called `init()`, with or without `release()`.

Left to interpreter shutdown, torch's gloo process group is torn down while its worker threads
may still drop Python objects of the last collectives; such a thread cannot take the GIL any
more and the process aborts ("terminate called without an active exception", SIGABRT), so the
launcher reports a job that did all its work as failed.

- `install`: called by `init()`; registers `_at_exit` with `atexit` (once per process) and
  chains `sys.excepthook` so that an uncaught exception marks the exit as failing.
- `_at_exit`: a script that ended normally (or through ``sys.exit``) leaves the job as
  `release()` does: a barrier through the rendezvous store, bounded by `exit_wait` so that a
  rank never waits long for peers that are still busy or gone, then the process groups are
  destroyed while the interpreter is still whole. A script that raised is left alone but for
  a `RAISED_PAUSE_S` pause in which torch's worker threads finish with the last collectives:
  it waits for nobody, its traceback is its last output, and it ends before its peers notice.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from types import TracebackType

EXIT_WAIT_S = 10.0
RAISED_PAUSE_S = 0.05

_installed_pid: int | None = None  # the process that registered the hook (a fork re-registers)
_raised = False  # an uncaught exception reached sys.excepthook in this process


def exit_wait(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long the exit barrier waits for the other ranks: `EXIT_WAIT_S`, at most `timeout`.

    Example:
        >>> exit_wait(datetime.timedelta(seconds=3)).total_seconds()
        3.0
    """
    return min(timeout, datetime.timedelta(seconds=EXIT_WAIT_S))


def install() -> None:
    """Register the exit hook and the excepthook wrapper (idempotent, per process)."""
    global _installed_pid, _raised
    if _installed_pid == os.getpid():
        return
    _installed_pid, _raised = os.getpid(), False
    previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        global _raised
        _raised = True
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def script_raised() -> bool:
    """Whether an uncaught exception ended (or is ending) this process's script: seen by the
    wrapped excepthook, or (a hook installed later replaced it, e.g. rich's or IPython's) by
    ``sys.last_value``, which the interpreter sets before exit handlers run."""
    return _raised or getattr(sys, "last_value", None) is not None


def _at_exit() -> None:
    if _installed_pid != os.getpid():
        return
    if script_raised():
        # A raising script keeps torch's own teardown: destroying its groups here would close
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
