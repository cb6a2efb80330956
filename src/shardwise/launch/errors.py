"""The launcher's exceptions and exit codes.

- `RendezvousError`: the job could not be formed (timeout, unreachable store, duplicate node
  rank, too many workers); its message says what to do.
- `LauncherInterrupted`: the launcher got SIGINT/SIGTERM/SIGHUP/SIGQUIT while waiting.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
EXIT_RENDEZVOUS = 3


class RendezvousError(Exception):
    """The job could not be formed; the message tells the user what to start or change."""


class LauncherInterrupted(Exception):
    """The launcher received a stop signal.

    Attributes:
        signum: the signal number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """``128 + signum`` (130 for SIGINT, 143 for SIGTERM), as a shell reports it."""
        return 128 + self.signum
