"""Writing a file atomically: `write_text_atomically` (and `write_bytes_atomically`, its binary
twin) writes to a temporary name in the target's folder (created when missing) and renames it
over the target, so that a reader (or another rank writing the same path) never sees half a
file; the file gets the permissions ``open()`` would give it (0666 less the umask)."""

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
    return write_bytes_atomically(path, text.encode("utf-8"))


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
        os.chmod(tmp, 0o666 & ~_umask())  # (mkstemp makes it 0600: as open() would instead)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
