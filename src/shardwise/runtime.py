"""Per-rank runtime limits: `set_memory(max_size=...)` (MindSpore's ``runtime.set_memory``).

`set_memory(max_size="28GB")` caps the memory one rank may use. `AutoParallel.plan` estimates
this rank's bytes from the plan and calls `check_memory` before any parameter is cut or
materialized: parameters (the local block of every planned parameter plus the whole of every
replicated one, by dtype size), their gradients (the same blocks, for parameters that require
grad) and activations (every primitive output's local block, as float32, all kept for
backward: an upper bound for one step). A plan over the cap raises ValueError naming the cap,
the estimate by kind and the three largest tensors. Optimizer state is not counted (it depends
on the optimizer; see the optimizer-parallel docs).

Sizes: an int in bytes or a string ``"<number><unit>"`` with unit B, KB, MB, GB or TB (powers
of 1024, case-insensitive), e.g. ``"512MB"``, ``"28GB"``, ``"1.5GB"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*$", re.IGNORECASE)

_max_size: int | None = None


@dataclass(frozen=True)
class TensorEstimate:
    """One tensor this rank holds: its name, local shape, dtype and kind (``"parameters"``,
    ``"gradients"``, ``"activations"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "parameters"

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def parse_size(size: int | str) -> int:
    """Bytes of `size` (an int in bytes or ``"512MB"``-style string).

    Raises:
        ValueError: not a positive int or a ``"<number><B|KB|MB|GB|TB>"`` string.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"set_memory: max_size={size!r} must be a positive number of bytes")
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(
            f"set_memory: max_size={size!r} is invalid; valid: an int in bytes or a string like "
            f"'512MB', '28GB' (units B, KB, MB, GB, TB; powers of 1024)"
        )
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if nbytes <= 0:
        raise ValueError(f"set_memory: max_size={size!r} must be positive")
    return nbytes


def set_memory(max_size: int | str | None = None) -> None:
    """Cap this rank's memory; `max_size` None removes the cap.

    Example:
        >>> sw.runtime.set_memory(max_size="28GB")
        >>> sw.runtime.get_memory()
        30064771072
    """
    global _max_size
    _max_size = None if max_size is None else parse_size(max_size)


def get_memory() -> int | None:
    """The cap in bytes, or None."""
    return _max_size


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest unit that keeps it >= 1 (e.g. ``"1.50 MB"``)."""
    for unit in ("TB", "GB", "MB", "KB"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.2f} {unit}"
    return f"{nbytes} B"


def check_memory(tensors: Sequence[TensorEstimate], what: str) -> int:
    """The estimated bytes of `tensors`; raise if above the `set_memory` cap.

    Raises:
        ValueError: the estimate exceeds the cap; names the cap, the estimate and the three
            largest tensors with their local shapes.
    """
    total = sum(t.nbytes for t in tensors)
    if _max_size is None or total <= _max_size:
        return total
    kinds: dict[str, int] = {}
    for t in tensors:
        kinds[t.kind] = kinds.get(t.kind, 0) + t.nbytes
    parts = ", ".join(f"{k} {format_size(n)}" for k, n in kinds.items())
    largest = sorted(tensors, key=lambda t: t.nbytes, reverse=True)[:3]
    names = ", ".join(
        f"{t.name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')} ({format_size(t.nbytes)})"
        for t in largest
    )
    raise ValueError(
        f"{what}: this rank needs an estimated {format_size(total)} ({total} bytes: {parts}), "
        f"above the set_memory cap max_size={format_size(_max_size)} ({_max_size} bytes); "
        f"largest: {names}. Shard the largest tensors further or raise the cap with "
        f"shardwise.runtime.set_memory(max_size=...)"
    )
