"""Publishing a checkpoint written elsewhere: all of it at once, or nothing.

- `publish`: a hidden path next to the destination to write into; renamed (or, replacing an
  existing destination, swapped in one step by `_exchange`) into place when the block ends
  without error, removed on an error. A killed writer leaves the destination as it was.
- `_remove_stale`: the hidden partial outputs that killed writers of this host left next to
  the destination (their process is gone) are removed before a new one starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from shardwise.checkpoint._errors import CheckpointError

_OWNER = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())  # a partial output's host


@contextlib.contextmanager
def publish(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden path next to `dst` to write into (a file or a folder), renamed to `dst` when
    the block ends without error; on an error (or a kill) `dst` is left as it was."""
    if dst.exists() and not overwrite:
        raise CheckpointError(
            f"{dst} exists; pass overwrite=True to replace it (once the new one is complete), "
            "or choose another destination"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dst)
    tmp = dst.with_name(f".{dst.name}.partial-{_OWNER}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if dst.exists() and _exchange(tmp, dst):  # (atomic: dst is the old or the new, always)
        _remove(tmp)
        return
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:6]}")
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        _remove(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot (the caller then renames the old one away first)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return bool(renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) == 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _remove_stale(dst: Path) -> None:
    """Remove the hidden partial outputs next to `dst` left by killed transforms of this host
    (their process is gone; a live one's, or another host's, are left alone)."""
    for path in dst.parent.glob(f".{glob.escape(dst.name)}.partial-{_OWNER}-*"):
        pid = path.name[len(f".{dst.name}.partial-{_OWNER}-") :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
