"""Writing a file atomically: `write_text_atomically` (and `write_bytes_atomically`, its binary
twin) writes to a temporary name in the target's folder (created when missing) and renames it
over the target, so that a reader (or another rank writing the same path) never sees half a
file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename.

    Returns:
        The path written.

    Example:
        >>> write_text_atomically("plan.json", "{}\\n")
        PosixPath('plan.json')
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_bytes_atomically(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` through a temporary file and a rename (`write_text_atomically`'s
    binary twin).

    Returns:
        The path written.

    Example:
        >>> write_bytes_atomically("plan.png", png_bytes)
        PosixPath('plan.png')
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
