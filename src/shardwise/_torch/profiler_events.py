"""The profiler's event tree: every CPU allocation and free, and the named ranges.

`report/_measure.py` (`MemoryMeter`) needs each allocation event of torch's CPU allocator
(time, signed size, address), which ``torch.profiler`` records with ``profile_memory=True``
but reports publicly only as per-op totals; the private event tree
(``kineto_results.experimental_event_tree()``) has them as ``_ExtraFields_Allocation``
records.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.profiler import profile


class Allocation(NamedTuple):
    """One allocation (`nbytes` > 0) or free (`nbytes` < 0) of the CPU allocator."""

    time_ns: int
    nbytes: int
    ptr: int


class Range(NamedTuple):
    """An event that is not a CPU allocation (a ``record_function`` range, an op)."""

    name: str
    start_ns: int
    end_ns: int


def events(prof: profile, names: str) -> Iterator[Allocation | Range]:
    """The CPU allocations of a finished `prof` and its ranges whose names start with `names`,
    depth-first in time order."""
    assert prof.profiler is not None, "the profiler has not run"
    results: Any = prof.profiler.kineto_results
    roots: list[Any] = results.experimental_event_tree()
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))
        fields = type(node.extra_fields).__name__
        if fields == "_ExtraFields_Allocation" and node.extra_fields.device.type == "cpu":
            e = node.extra_fields
            yield Allocation(node.start_time_ns, int(e.alloc_size), int(e.ptr))
        elif node.name.startswith(names):
            yield Range(node.name, node.start_time_ns, node.end_time_ns)
