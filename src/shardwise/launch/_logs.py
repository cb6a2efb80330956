"""What a worker's exit and log say: the pieces of the launcher's report (`report`).

- `describe_returncode`: ``exit code 1`` / ``signal SIGKILL`` from a ``Popen.returncode``.
- `log_lines`: a worker log's lines, a traceback that followed output without a newline (a
  prompt, ``input("prompt> ")``) starting a line of its own.
- `shorten_line`: one very long line (a progress bar, a dump without newlines) cut to
  `MAX_LINE_CHARS`, its start and its end kept.
- `extract_traceback`: the last Python traceback of a worker log, up to a crash dump that
  follows it (`DUMP_START`) or the end, capped (`cap_traceback`: library frames are left out
  first, the user's outermost and last frames stay); `crash_dump`: faulthandler's dump of a
  native crash; `log_excerpt` reads the log: the traceback, then the crash dump, or its last
  lines when it has neither, each line shortened (`shorten_line`).
- `PEER_LOST`: a log line saying the worker failed because another rank went away.
- `ends_in_traceback`: whether a worker log's last output is an uncaught traceback (strict:
  for a worker that never called ``init()``, whose trace file cannot say that it failed).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sysconfig
from pathlib import Path, PurePath

TRACEBACK_HEADER = "Traceback (most recent call last):"
FATAL_HEADER = "Fatal Python error:"  # faulthandler's, on a native crash (SIGSEGV, SIGABRT)
ABORT_LINE = "terminate called "  # libstdc++'s, before a C++ abort (SIGABRT)
DUMP_START = re.compile(
    rf"({re.escape(FATAL_HEADER)}|{ABORT_LINE}|"
    r"(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent)"
)
"""A line that starts a dump of the process's own (a crash, or faulthandler's stacks): it ends
the traceback before it."""
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
MAX_TRACEBACK_LINES = 30
TAIL_LINES = 10
MAX_LINE_CHARS = 400
"""The longest line of a log excerpt (`shorten_line`): a longer one keeps its first
`MAX_LINE_CHARS` - 100 and last 100 characters."""
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote process exited|"
    r"peer process (closed|exited)",
    re.IGNORECASE,
)
"""A worker log line saying that the worker failed because another rank went away."""
_TAIL_BYTES = 256 * 1024
_FRAME_FILE = re.compile(r'  File "([^"]*)"')
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_THREAD_START = re.compile(r"(Current thread|Thread) 0x[0-9a-fA-F]+ ")
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


def log_lines(text: str) -> list[str]:
    """The lines of a worker's output, right-stripped, without torch's ``[rankN]: `` prefix;
    a traceback header after other text on its line (``prompt> Traceback (most recent call
    last):``, output that did not end in a newline) starts a line of its own.

    Example:
        >>> log_lines("prompt> Traceback (most recent call last):\\n  f()")
        ['prompt> ', 'Traceback (most recent call last):', '  f()']
    """
    lines: list[str] = []
    for raw in text.splitlines():
        line = RANK_PREFIX.sub("", raw.rstrip())
        at = line.find(TRACEBACK_HEADER)
        if at > 0:
            lines.append(line[:at])
            line = line[at:]
        lines.append(line)
    return lines


def shorten_line(line: str, max_chars: int = MAX_LINE_CHARS) -> str:
    """`line`, or when longer than `max_chars`, its start and its last 100 characters (a
    quarter of `max_chars` when less) around ``... (N characters left out) ...``.

    Example:
        >>> shorten_line("x" * 1000, 40)
        'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx ... (960 characters left out) ... xxxxxxxxxx'
    """
    if len(line) <= max_chars:
        return line
    tail = min(100, max_chars // 4)
    head = max_chars - tail
    return f"{line[:head]} ... ({len(line) - max_chars} characters left out) ... {line[-tail:]}"


def extract_traceback(text: str, max_lines: int = MAX_TRACEBACK_LINES) -> list[str]:
    """The last Python traceback in `text`, from its header to the end of the text, or to the
    first line after it that starts a dump (`DUMP_START`: a native crash in the teardown after
    an exception, "terminate called ...", "Fatal Python error: Aborted" and every thread's
    stack, is not part of the exception).

    Args:
        text: a worker's output.
        max_lines: cap; a longer traceback keeps its header, its exception and the user's
            own frames, leaving library frames out first (`cap_traceback`).

    Returns:
        The traceback's lines (trailing blank lines and Python's ``^^^^`` / ``~~~~`` position
        markers removed), or ``[]`` when there is none.

    Example:
        >>> extract_traceback("x\\nTraceback (most recent call last):\\n  f()\\nE: boom\\n")
        ['Traceback (most recent call last):', '  f()', 'E: boom']
    """
    lines = log_lines(text)  # (torch's excepthook prefixes every line with "[rankN]: ")
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    if not starts:
        return []
    # (Python 3.11's ^^^^ / ~~~~ marker lines under a call take room from the user's frames)
    end = next((i for i in range(starts[-1] + 1, len(lines)) if DUMP_START.match(lines[i])), None)
    tb = [line for line in lines[starts[-1] : end] if not _MARKERS.fullmatch(line)]
    while tb and not tb[-1]:
        tb.pop()
    return cap_traceback(tb, max_lines) if len(tb) > max_lines else tb


def cap_traceback(tb: list[str], max_lines: int) -> list[str]:
    """`tb` (a traceback's lines, header first) in at most `max_lines` lines, frames left out
    (each run replaced by a ``... (N lines left out)`` line) in this order: library frames
    (`is_library_file`) farthest from the exception first, then the user's own frames between
    its outermost and its last; the header, the exception and those two user frames stay.

    Without room for that (a very long exception message), the header and the last lines.

    Example:
        >>> tb = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
        ...       "    f()", '  File "a.py", line 2, in f', "    g()", "E: boom"]
        >>> capped = cap_traceback(tb, 5)
        >>> capped[1], capped[3]
        ('  File "a.py", line 1, in <module>', '  ... (2 lines left out)')
    """
    frames: list[list[str]] = []
    at = 1
    while at < len(tb) and tb[at].startswith("  "):  # (the exception's lines are not indented)
        if tb[at].startswith("  File ") or not frames:
            frames.append([tb[at]])
        else:  # its code, or "[Previous line repeated 996 more times]"
            frames[-1].append(tb[at])
        at += 1
    tail = tb[at:]
    if not frames or len(tail) + 3 > max_lines:
        kept = max_lines - 2
        return [tb[0], f"  ... ({len(tb) - 1 - kept} lines left out)", *tb[-kept:]]
    user = [k for k, f in enumerate(frames) if not is_library_file(_frame_file(f[0]))]
    library = [k for k in range(len(frames)) if k not in user]
    order = [*dict.fromkeys([*user[:1], *user[-1:], *reversed(user), *reversed(library)])]
    kept_frames: set[int] = set()
    for k in order:
        if len(_render(tb[0], frames, tail, kept_frames | {k})) <= max_lines:
            kept_frames.add(k)
    return _render(tb[0], frames, tail, kept_frames)


def _render(head: str, frames: list[list[str]], tail: list[str], kept: set[int]) -> list[str]:
    out, gap = [head], 0
    for k, frame in enumerate(frames):
        if k not in kept:
            gap += len(frame)
            continue
        if gap:
            out.append(f"  ... ({gap} lines left out)")
        out += frame
        gap = 0
    if gap:
        out.append(f"  ... ({gap} lines left out)")
    return out + tail


def _frame_file(line: str) -> str:
    match = _FRAME_FILE.match(line)
    return match.group(1) if match else ""


def is_library_file(path: str) -> bool:
    """Whether a traceback's frame file is library code, not the user's: Python's own
    (``<frozen ...>``, the standard library), an installed package (``site-packages``,
    ``dist-packages``), or a file of the ``shardwise`` or ``torch`` package wherever it lies
    (a folder of that name holding an ``__init__.py``).

    Example:
        >>> is_library_file("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py")
        True
        >>> is_library_file("/work/train.py")
        False
    """
    if not path or path.startswith("<frozen") or path.startswith(_STDLIB):
        return True
    parts = PurePath(path).parts
    if any(part in ("site-packages", "dist-packages") for part in parts):
        return True
    return any(
        part in ("shardwise", "torch") and _is_package(str(PurePath(*parts[: k + 1])))
        for k, part in enumerate(parts[:-1])
    )


@functools.lru_cache(maxsize=256)
def _is_package(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "__init__.py"))


def _read_tail(path: str | Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def ends_in_traceback(path: str | Path) -> bool:
    """Whether the log at `path` ends in an uncaught Python traceback: its last traceback has
    its exception on one line, right after its frames, and nothing follows but a crash dump
    (`DUMP_START`); a thread's (``Exception in thread ...`` before it) does not count. Strict,
    for a worker that never called ``init()`` (see `supervisor.is_failing`): a multi-line
    exception message is not seen, a handled traceback followed by other output is not taken.

    Example:
        >>> ends_in_traceback("/nonexistent/worker_0.log")
        False
    """
    try:
        text = _read_tail(path)
    except OSError:
        return False
    lines = log_lines(text)
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    if not starts or (starts[-1] > 0 and lines[starts[-1] - 1].startswith("Exception in thread")):
        return False
    body = [line for line in lines[starts[-1] + 1 :] if not _MARKERS.fullmatch(line)]
    end = next((i for i, line in enumerate(body) if DUMP_START.match(line)), len(body))
    body = body[:end]
    while body and not body[-1]:
        body.pop()
    frames = 0
    while frames < len(body) and body[frames].startswith("  "):
        frames += 1
    return (
        frames > 0 and len(body) == frames + 1 and _EXCEPTION_LINE.fullmatch(body[-1]) is not None
    )


def crash_dump(text: str, max_lines: int = MAX_TRACEBACK_LINES) -> list[str]:
    """faulthandler's dump of a native crash in `text`: from its last "Fatal Python error:" line
    (and the "terminate called ..." line just before it), without the list of extension
    modules, in at most `max_lines` lines (`order_stacks`: the crashing thread's stack first,
    which faulthandler prints last); ``[]`` when there is none.

    Example:
        >>> crash_dump("Fatal Python error: Aborted\\n\\nExtension modules: torch._C (total: 1)")
        ['Fatal Python error: Aborted']
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    crash = [i for i, line in enumerate(lines) if line.startswith(FATAL_HEADER)]
    if not crash:
        return []
    start = crash[-1] - (crash[-1] > 0 and lines[crash[-1] - 1].startswith(ABORT_LINE))
    return order_stacks(
        [line for line in lines[start:] if not line.startswith("Extension modules:")], max_lines
    )


def order_stacks(dump: list[str], max_lines: int) -> list[str]:
    """faulthandler's `dump` (its lines before the first thread, then one block per thread,
    the other threads first and the ``Current thread`` last) in at most `max_lines` lines: the
    lines before the threads and the current thread's whole block first, then the other
    threads' blocks, in their order, as long as each fits; a ``... (N other threads' stacks
    left out)`` line says what did not.

    Example:
        >>> order_stacks(["Fatal Python error: Aborted", "Thread 0x1 (most recent call first):",
        ...     "  File 'a.py', line 1 in idle", "Current thread 0x2 (most recent call first):",
        ...     "  File 'a.py', line 9 in crash"], 4)
        ['Fatal Python error: Aborted', 'Current thread 0x2 (most recent call first):', \
"  File 'a.py', line 9 in crash", "  ... (1 other thread's stack left out)"]
    """
    starts = [i for i, line in enumerate(dump) if _THREAD_START.match(line)]
    blocks = [dump[a:b] for a, b in zip(starts, [*starts[1:], len(dump)], strict=False)]
    current = [b for b in blocks if b[0].startswith("Current thread")][-1:]
    others = [b for b in blocks if b not in current]
    out = [*dump[: starts[0] if starts else len(dump)], *(current[0] if current else [])]
    if len(out) + sum(len(b) for b in others) <= max_lines:
        return [*out, *(line for b in others for line in b)]
    if len(out) > max_lines - 1:  # (the crashing thread's stack alone is too long)
        more = len(out) - max_lines + 1 + sum(len(b) for b in others)
        return [*out[: max_lines - 1], f"  ... ({more} more lines)"]
    left_out = 0
    for block in others:
        if len(out) + len(block) <= max_lines - 1:
            out += block
        else:
            left_out += 1
    threads = "other thread's stack" if left_out == 1 else "other threads' stacks"
    return [*out, f"  ... ({left_out} {threads} left out)"]


def log_excerpt(path: str | Path, max_lines: int = MAX_TRACEBACK_LINES) -> tuple[list[str], bool]:
    """What to show of a failed worker's log.

    Args:
        path: the worker log.
        max_lines: cap for the traceback, and for the crash dump.

    Returns:
        ``(lines, is_traceback)``: the last traceback, then the crash dump that followed it
        (`crash_dump`: a native crash in the teardown), if any; without a traceback, the crash
        dump (faulthandler's stacks, past the last `TAIL_LINES` lines too), or else the last
        `TAIL_LINES` lines; each line at most about `MAX_LINE_CHARS` long (`shorten_line`).

    Example:
        >>> log_excerpt("/nonexistent/worker_0.log")
        (['(no log at /nonexistent/worker_0.log)'], False)
    """
    lines, is_tb = _excerpt(path, max_lines)
    return [shorten_line(line) for line in lines], is_tb


def _excerpt(path: str | Path, max_lines: int) -> tuple[list[str], bool]:
    try:
        text = _read_tail(path)
    except OSError:
        return [f"(no log at {path})"], False
    tb = extract_traceback(text, max_lines)
    tb_at = text.rfind(TRACEBACK_HEADER)
    dump = crash_dump(text[tb_at:] if tb else text, max_lines)
    if tb:
        return [*tb, *dump], True
    if dump:
        return dump, False
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return (lines[-TAIL_LINES:] or [f"({Path(path).name} is empty)"]), False
