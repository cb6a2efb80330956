"""Publishing a checkpoint written elsewhere: all of it at once, or nothing.

- `publish`: a hidden path next to the destination to write into; renamed (or, replacing an
  existing destination, swapped in one step by `_exchange`) into place when the block ends
  without error, removed on an error. A killed writer leaves the destination as it was.
- `_remove_stale`: the hidden partial outputs that killed writers left next to the destination
  are removed before a new one starts: a writer holds an ``flock`` on a lock file beside its
  output while it writes, so an output whose lock is free is a dead writer's (without flock:
  a writer of this host whose process is gone).
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
_LOCK = ".lock"  # beside a partial output: held (flock) while it is written

try:
    import fcntl
except ImportError:  # (Windows: no flock; a writer's process id decides)
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def publish(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden path next to `dst` to write into (a file or a folder), renamed to `dst` when
    the block ends without error; on an error (or a kill) `dst` is left as it was. While it
    is written, a lock file beside it is held (`_held`): that is how a later writer tells a
    killed writer's leftovers from a live one's."""
    if dst.exists() and not overwrite:
        raise CheckpointError(
            f"{dst} exists; pass overwrite=True to replace it (once the new one is complete), "
            "or choose another destination"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dst)
    tmp = dst.with_name(f".{dst.name}.partial-{_OWNER}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    with _held(tmp.with_name(tmp.name + _LOCK)):
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


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive ``flock`` on `lock` for the block (the file is removed after it)."""
    handle = open(lock, "w")  # noqa: SIM115 (closed below)
    try:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        lock.unlink(missing_ok=True)
        handle.close()


def _writer_gone(path: Path) -> bool:
    """Whether the writer of a partial output has ended: its lock file is not held (where
    ``flock`` exists), else its process (same host) is gone."""
    lock = path.with_name(path.name + _LOCK)
    if fcntl is not None and lock.exists():
        with open(lock) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True
    pid = path.name.split(".partial-", 1)[-1][len(_OWNER) + 1 :].partition("-")[0]
    return pid.isdigit() and not _alive(int(pid))


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
    """Remove the hidden partial outputs next to `dst` whose writer is gone (killed): a live
    writer's, or another host's without a lock file, are left alone."""
    for path in dst.parent.glob(f".{glob.escape(dst.name)}.partial-*"):
        if path.name.endswith(_LOCK):
            continue
        lock = path.with_name(path.name + _LOCK)
        mine = path.name.startswith(f".{dst.name}.partial-{_OWNER}-")
        if (lock.exists() or mine) and _writer_gone(path):
            _remove(path)
            lock.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
