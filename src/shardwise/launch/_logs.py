"""What a worker's exit and log say: the pieces of the launcher's report (`report`).

- `describe_returncode`: ``exit code 1`` / ``signal SIGKILL`` from a ``Popen.returncode``.
- `extract_traceback`: the last Python traceback of a worker log, capped (`log_excerpt` reads
  the log and falls back to its last lines when there is no traceback).
- `PEER_LOST`: a log line saying the worker failed because another rank went away.
- `ends_in_traceback`: whether a worker log's last output is a finished traceback (the worker
  failed on its own, even when the launcher's SIGTERM ends it during its teardown).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

TRACEBACK_HEADER = "Traceback (most recent call last):"
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
MAX_TRACEBACK_LINES = 30
TAIL_LINES = 10
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote process exited|"
    r"peer process (closed|exited)",
    re.IGNORECASE,
)
"""A worker log line saying that the worker failed because another rank went away."""
_TAIL_BYTES = 256 * 1024
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: .*|Error|Exception|Interrupt|Exit)")


def describe_returncode(returncode: int) -> str:
    """Human form of a ``Popen.returncode``.

    Args:
        returncode: the process's return code; negative means killed by signal ``-code``.

    Returns:
        ``"exit code N"`` or ``"signal SIGNAME"``.

    Example:
        >>> describe_returncode(-9)
        'signal SIGKILL'
        >>> describe_returncode(3)
        'exit code 3'
    """
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


_MARKERS = re.compile(r"\s*[\^~]+[\s\^~]*")


def extract_traceback(text: str, max_lines: int = MAX_TRACEBACK_LINES) -> list[str]:
    """The last Python traceback in `text`, from its header to the end of the text.

    Args:
        text: a worker's output.
        max_lines: cap; a longer traceback keeps its header and its last lines (where the
            exception is), with a line saying how many were left out.

    Returns:
        The traceback's lines (trailing blank lines and Python's ``^^^^`` / ``~~~~`` position
        markers removed), or ``[]`` when there is none.

    Example:
        >>> extract_traceback("x\\nTraceback (most recent call last):\\n  f()\\nE: boom\\n")
        ['Traceback (most recent call last):', '  f()', 'E: boom']
    """
    # torch.distributed's excepthook prefixes every line with "[rankN]: "
    lines = [RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    if not starts:
        return []
    # (Python 3.11's ^^^^ / ~~~~ marker lines under a call take room from the user's frames)
    tb = [line for line in lines[starts[-1] :] if not _MARKERS.fullmatch(line)]
    while tb and not tb[-1]:
        tb.pop()
    if len(tb) > max_lines:
        kept = max_lines - 2
        tb = [tb[0], f"  ... ({len(tb) - 1 - kept} lines left out)", *tb[-kept:]]
    return tb


def _read_tail(path: str | Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def ends_in_traceback(path: str | Path) -> bool:
    """Whether the log at `path` ends in a finished Python traceback (its exception line last).

    Example:
        >>> ends_in_traceback("/nonexistent/worker_0.log")
        False
    """
    try:
        tb = extract_traceback(_read_tail(path))
    except OSError:
        return False
    return len(tb) > 1 and _EXCEPTION_LINE.fullmatch(tb[-1]) is not None


def log_excerpt(path: str | Path, max_lines: int = MAX_TRACEBACK_LINES) -> tuple[list[str], bool]:
    """What to show of a failed worker's log.

    Args:
        path: the worker log.
        max_lines: cap for the traceback.

    Returns:
        ``(lines, is_traceback)``: the last traceback, or else the last `TAIL_LINES` lines.

    Example:
        >>> log_excerpt("/nonexistent/worker_0.log")
        (['(no log at /nonexistent/worker_0.log)'], False)
    """
    try:
        text = _read_tail(path)
    except OSError:
        return [f"(no log at {path})"], False
    tb = extract_traceback(text, max_lines)
    if tb:
        return tb, True
    tail = [line.rstrip() for line in text.splitlines() if line.strip()][-TAIL_LINES:]
    return (tail or [f"({Path(path).name} is empty)"]), False
