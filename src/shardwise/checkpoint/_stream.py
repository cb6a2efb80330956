"""safetensors files read and written one tensor at a time (bounded memory, no mmap, no pickle).

The format: an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape
and byte range; ``__metadata__``: strings), then the tensors' bytes back to back. The header may
end in spaces, which is how `StreamWriter` reserves room for the checksums it only knows at
the end.

- `FileIndex` / `read_index`: a file's header (tensor entries, metadata, where data starts).
- `read_entry`: one tensor into a fresh buffer (or a reused one), its CRC-32 checked against
  the file's ``shardwise.checksums`` when present.
- `StreamWriter`: declare every entry up front, `write` them in order (each checksummed as
  written), `close` to fill in the header; files written this way load with
  ``safetensors.torch.load_file`` and `shardwise.load_checkpoint`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: dtype, shape and byte range within the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True)
class FileIndex:
    """A safetensors file's header: its entries, metadata and the data section's offset."""

    path: Path
    entries: Mapping[str, Entry]
    metadata: Mapping[str, str]
    data_start: int
    checksums: Mapping[str, int]


def read_index(path: Path) -> FileIndex:
    """Parse `path`'s header (`CheckpointError` when it is not a safetensors file)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= _MAX_HEADER:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
        metadata = dict(header.pop("__metadata__", None) or {})
        entries = {
            k: Entry(DTYPES[v["dtype"]], tuple(v["shape"]), *map(int, v["data_offsets"]))
            for k, v in header.items()
        }
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors checkpoint ({e}); the file is truncated, "
            "corrupt or in another format (shardwise never unpickles)"
        ) from None
    sums = fmt.parse_json(path, metadata, fmt.KEY_CHECKSUMS) or {}
    index = FileIndex(path, entries, metadata, 8 + n, {k: int(v) for k, v in sums.items()})
    _check_sizes(index)
    return index


def _check_sizes(index: FileIndex) -> None:
    """Each entry's byte range fits its dtype and shape, and the file holds them all."""
    for key, e in index.entries.items():
        want = int(torch.Size(e.shape).numel()) * e.dtype.itemsize
        if e.stop - e.start != want:
            raise CheckpointError(
                f"{index.path}: tensor {key!r} spans {e.stop - e.start} bytes but is "
                f"{list(e.shape)} of {e.dtype} ({want} bytes); the file is corrupt"
            )
    end = index.data_start + max((e.stop for e in index.entries.values()), default=0)
    size = index.path.stat().st_size
    if size < end:
        raise CheckpointError(
            f"{index.path}: the file is truncated ({size} bytes, its header needs {end}): an "
            "interrupted copy or save; copy it again or use another checkpoint"
        )


def read_entry(
    index: FileIndex, name: str, verify: bool = True, into: torch.Tensor | None = None
) -> torch.Tensor:
    """Entry `name` of the file as a CPU tensor (checksum verified): a new one, or a view of
    the start of the byte buffer `into` (uint8, large enough)."""
    e = index.entries[name]
    buf = (
        torch.empty(e.stop - e.start, dtype=torch.uint8)
        if into is None
        else into[: e.stop - e.start]
    )
    with open(index.path, "rb") as f:
        f.seek(index.data_start + e.start)
        got = f.readinto(buf.numpy().data)
    if got != e.stop - e.start:
        raise CheckpointError(f"{index.path}: tensor {name!r} is truncated")
    if verify and name in index.checksums and fmt.checksum(buf) != index.checksums[name]:
        raise CheckpointError(
            f"{index.path}: tensor {name!r} is corrupt (checksum mismatch: its bytes changed "
            "after it was saved); restore the file from a copy or use another checkpoint"
        )
    return buf.view(e.dtype).reshape(e.shape) if e.shape else buf.view(e.dtype).reshape(())


class StreamWriter:
    """A safetensors file written entry by entry.

    Args:
        path: the file to create.
        specs: every entry as (name, dtype, shape), in the order they will be written.
        metadata: string metadata (``shardwise.checksums`` is added).

    Example:
        >>> with StreamWriter(p, [("w", torch.float32, (2, 3))], {"format": "pt"}) as w:
        ...     w.write("w", torch.zeros(2, 3))
    """

    def __init__(
        self,
        path: Path,
        specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str],
    ) -> None:
        self.path, self.order = path, [s[0] for s in specs]
        self.sums: dict[str, int] = {}
        header: dict[str, Any] = {}
        offset = 0
        for name, dtype, shape in specs:
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        self.header, self.metadata = header, dict(metadata)
        self.length = len(self._header_bytes({n: 0xFFFFFFFF for n in self.order}))
        self.length += -(self.length + 8) % 8
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(struct.pack("<Q", self.length) + b" " * self.length)
        self.next = 0

    def _header_bytes(self, sums: Mapping[str, int]) -> bytes:
        meta = dict(self.metadata, **{fmt.KEY_CHECKSUMS: json.dumps(dict(sums))})
        return json.dumps({"__metadata__": meta, **self.header}, separators=(",", ":")).encode()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append entry `name` (the next one declared), checksumming it."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise CheckpointError(f"{self.path}: {name!r} written out of the declared order")
        want = self.header[name]
        if list(tensor.shape) != want["shape"] or NAMES[tensor.dtype] != want["dtype"]:
            raise CheckpointError(
                f"{self.path}: {name!r} is {tensor.dtype}{list(tensor.shape)}, declared "
                f"{want['dtype']}{want['shape']}"
            )
        flat = tensor.detach().contiguous()
        self.sums[name] = fmt.checksum(flat)
        self.file.write(flat.reshape(-1).view(torch.uint8).numpy().data)
        self.next += 1

    def close(self) -> None:
        """Fill in the header's checksums and sync the file."""
        if self.next != len(self.order):
            raise CheckpointError(f"{self.path}: {self.order[self.next]!r} was never written")
        header = self._header_bytes(self.sums)
        self.file.seek(8)
        self.file.write(header + b" " * (self.length - len(header)))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abort(self) -> None:
        """Close and delete the unfinished file."""
        self.file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
