"""Read and write IDX files, the format of the original MNIST distribution (plain or gzip).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of dimensions),
one big-endian uint32 per dimension, then the values in row-major order, big-endian.

- `read_idx`: one file -> a torch tensor, checking magic, type code and size against the header.
- `write_idx`: a tensor -> one file (used by the tests and handy for making small fixtures).
- `find_idx_file`: which spelling of a file a directory holds (``-idx3-ubyte``, ``.idx3-ubyte``,
  each optionally ``.gz``).

Errors are `IdxFormatError` (a ValueError) and `IdxFileNotFoundError` (a FileNotFoundError);
both messages name the file and say what to do.
"""

from __future__ import annotations

import ctypes
import gzip
import math
import struct
import sys
from pathlib import Path

import torch

__all__ = [
    "IdxFileNotFoundError",
    "IdxFormatError",
    "find_idx_file",
    "read_idx",
    "write_idx",
]

# IDX type code -> (torch dtype, bytes per value)
_CODES: dict[int, tuple[torch.dtype, int]] = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}
_DTYPE_CODES = {dtype: code for code, (dtype, _) in _CODES.items()}


class IdxFormatError(ValueError):
    """An IDX file whose content does not match the format (magic, type code, size)."""


class IdxFileNotFoundError(FileNotFoundError):
    """A required IDX file is absent; the message names it and how to get it."""


def _read_bytes(path: Path) -> bytes:
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as f:
                return f.read()
        except (OSError, EOFError) as e:
            raise IdxFormatError(
                f"{path}: not a readable gzip file ({e}); delete it and fetch it again"
            ) from e
    return path.read_bytes()


def _parse_header(path: Path, raw: bytes) -> tuple[torch.dtype, int, tuple[int, ...], int]:
    """(dtype, itemsize, shape, header length) from the first bytes of an IDX file."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        head = raw[:4].hex() or "empty"
        raise IdxFormatError(
            f"{path}: wrong magic number 0x{head}: not an IDX file (expected 0x0000 followed by "
            "a type code and the number of dimensions); check that the file is the original "
            "MNIST IDX file"
        )
    code, ndim = raw[2], raw[3]
    if code not in _CODES:
        known = ", ".join(f"0x{c:02x}" for c in _CODES)
        raise IdxFormatError(f"{path}: unknown IDX type code 0x{code:02x} (known: {known})")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise IdxFormatError(
            f"{path}: truncated header: {ndim} dimensions need {header_len} bytes, the file has "
            f"{len(raw)}; delete it and fetch it again"
        )
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype, itemsize = _CODES[code]
    return dtype, itemsize, tuple(shape), header_len


def read_idx(path: str | Path) -> torch.Tensor:
    """Read one IDX file (plain, or gzip when the name ends in ``.gz``) into a tensor.

    Args:
        path: the file.

    Returns:
        A tensor with the header's shape and dtype (uint8 for MNIST), in native byte order.

    Raises:
        IdxFileNotFoundError: the file does not exist.
        IdxFormatError: wrong magic number, unknown type code, or a data size that does not
            match the header (truncated or trailing bytes).

    Example:
        >>> labels = read_idx("data/MNIST/train-labels-idx1-ubyte")
        >>> labels.shape, labels.dtype
        (torch.Size([60000]), torch.uint8)
    """
    p = Path(path)
    if not p.is_file():
        raise IdxFileNotFoundError(f"{p}: no such IDX file")
    raw = _read_bytes(p)
    dtype, itemsize, shape, header_len = _parse_header(p, raw)
    expected = math.prod(shape) * itemsize
    actual = len(raw) - header_len
    if actual < expected:
        raise IdxFormatError(
            f"{p}: truncated: the header promises shape {list(shape)} = {expected} data bytes, "
            f"the file holds {actual}; delete it and fetch it again"
        )
    if actual > expected:
        raise IdxFormatError(
            f"{p}: {actual - expected} trailing bytes after the {expected} data bytes of shape "
            f"{list(shape)}; the file is damaged or not an IDX file"
        )
    data = torch.frombuffer(bytearray(raw[header_len:]), dtype=torch.uint8)
    if itemsize > 1 and sys.byteorder == "little":
        data = data.view(-1, itemsize).flip(1).contiguous().view(-1)
    return data.view(dtype).reshape(shape)


def write_idx(path: str | Path, tensor: torch.Tensor) -> Path:
    """Write `tensor` as an IDX file (gzip-compressed when the name ends in ``.gz``).

    Args:
        path: the destination file; its folder must exist.
        tensor: uint8, int8, int16, int32, float32 or float64, at most 255 dimensions.

    Returns:
        The path written.

    Raises:
        TypeError: a dtype that IDX cannot store.

    Example:
        >>> write_idx(tmp / "t10k-labels-idx1-ubyte.gz", torch.tensor([7, 2, 1], dtype=torch.uint8))
    """
    p = Path(path)
    if tensor.dtype not in _DTYPE_CODES:
        known = ", ".join(str(d) for d in _DTYPE_CODES)
        raise TypeError(f"write_idx: IDX cannot store {tensor.dtype}; use one of {known}")
    t = tensor.detach().cpu().contiguous()
    header = bytes([0, 0, _DTYPE_CODES[t.dtype], t.dim()]) + struct.pack(f">{t.dim()}I", *t.shape)
    data = t.reshape(-1).view(torch.uint8)
    if t.element_size() > 1 and sys.byteorder == "little":
        data = data.view(-1, t.element_size()).flip(1)
    data = data.contiguous()
    body = ctypes.string_at(data.data_ptr(), data.numel()) if data.numel() else b""
    payload = header + body
    if p.suffix == ".gz":
        with gzip.open(p, "wb") as f:
            f.write(payload)
    else:
        p.write_bytes(payload)
    return p


def find_idx_file(directory: Path, prefix: str, kind: str, ndim: int) -> Path | None:
    """The file for e.g. ``prefix="train", kind="images", ndim=3`` in `directory`, or None.

    Accepts MindSpore's ``train-images-idx3-ubyte``, the original ``train-images.idx3-ubyte``
    and either with ``.gz``; the first existing one in that order wins.
    """
    for sep in ("-", "."):
        for ext in ("", ".gz"):
            candidate = directory / f"{prefix}-{kind}{sep}idx{ndim}-ubyte{ext}"
            if candidate.is_file():
                return candidate
    return None
