"""``LOG_DIR/scheduler.log``: the launcher's own timestamped record of the job.

`SchedulerLog.open` creates the log folder and the file: a single-node job starts a fresh file;
a multi-node launcher appends, so that launchers sharing a folder (one host, or a shared file
system) never erase each other's lines; every line names its node. `SchedulerLog.info` writes
one line (one ``write`` call, flushed at once).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TextIO

SCHEDULER_LOG = "scheduler.log"


class SchedulerLog:
    """A line-oriented, timestamped log file.

    Example:
        >>> log = SchedulerLog.open("/tmp/swrun_doc", truncate=True)
        >>> log.info("launcher started")
        >>> log.close()
    """

    def __init__(self, path: Path, stream: TextIO) -> None:
        self.path = path
        self._stream: TextIO | None = stream
        self.node = "node ?"
        self.host = socket.gethostname()

    @staticmethod
    def open(log_dir: str | Path, truncate: bool) -> SchedulerLog:
        """Create `log_dir` if needed and open its ``scheduler.log``.

        Args:
            log_dir: the folder.
            truncate: start a new file (single-node job) instead of appending.

        Returns:
            The open log.

        Raises:
            OSError: the folder or the file cannot be created; the message names the path.
        """
        folder = Path(log_dir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / SCHEDULER_LOG
        # Kept open for the launcher's lifetime; `close` closes it.
        stream = open(path, "w" if truncate else "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        return SchedulerLog(path, stream)

    def set_node(self, node_rank: int) -> None:
        """Label the following lines with this launcher's node rank."""
        self.node = f"node {node_rank}"

    def info(self, message: str) -> None:
        """Write ``<date time.ms> [node N host:pid] message`` (no-op once closed)."""
        if self._stream is None:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        prefix = f"{stamp}.{int(now % 1 * 1000):03d} [{self.node} {self.host}:{os.getpid()}]"
        text = "".join(f"{prefix} {line}\n" for line in message.splitlines() or [""])
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError:
            pass  # a full disk must not take the supervisor down with it

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
