"""Allocator-level memory of a real run: `MemoryMeter`, the bytes torch's CPU allocator holds.

`MemoryMeter` runs ``torch.profiler`` with ``profile_memory=True`` around a block of code.
While it runs, torch's CPU allocator reports every allocation and free of this thread with
its address and size; the meter keeps the running total of the blocks allocated while it
runs, minus their frees. Not RSS: freed memory counts as freed at once, whatever glibc
keeps mapped, and nothing outside torch's allocator counts (Python objects, gloo's own
buffers, the profiler's records).

Measure from before the network is built (``with MemoryMeter() as meter:`` around building,
planning and the steps): a tensor allocated before the meter started is invisible, and so is
its free. `MemoryMeter.window` marks a stretch (one training step) by a
``torch.profiler.record_function`` range; after the block, `MemoryMeter.peak` is the most
bytes held at once within it, `MemoryMeter.held_at` the bytes held when it began.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from shardwise._torch.profiler_events import Allocation, Range, events

_PREFIX = "shardwise.memory:"


@dataclass(frozen=True)
class _Window:
    start_ns: int
    end_ns: int


class MemoryMeter:
    """The bytes torch's CPU allocator holds over a block (see the module docstring).

    Example:
        >>> with MemoryMeter() as meter:
        ...     net = torch.nn.Linear(1024, 1024)  # 4 MiB of weight, counted
        ...     with meter.window("step"):
        ...         net(torch.ones(8, 1024)).sum().backward()
        >>> meter.peak("step") > 8 * 2**20  # weight + its gradient
        True
    """

    def __init__(self) -> None:
        self._prof: Any = None
        self._series: list[tuple[int, int]] = []  # (time ns, bytes held after the event)
        self._windows: dict[str, _Window] = {}

    def __enter__(self) -> MemoryMeter:
        if self._prof is not None:
            raise RuntimeError("MemoryMeter: already measuring (a meter runs once)")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._prof.__exit__(kind, exc, tb)
        if kind is None:
            self._read(events(self._prof, _PREFIX))

    @contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Mark the code inside as window `name` (a training step, say)."""
        if self._prof is None:
            raise RuntimeError("MemoryMeter.window: only inside `with MemoryMeter() as meter:`")
        with record_function(_PREFIX + name):
            yield

    def peak(self, name: str | None = None) -> int:
        """The most bytes held at once within window `name` (None: over the whole block),
        counting what was already held when it began."""
        if name is None:
            return max((b for _, b in self._series), default=0)
        w = self._window(name)
        inside = [b for t, b in self._series if w.start_ns <= t <= w.end_ns]
        return max([self.held_at(name), *inside])

    def held_at(self, name: str) -> int:
        """The bytes held when window `name` began."""
        w = self._window(name)
        before = [b for t, b in self._series if t < w.start_ns]
        return before[-1] if before else 0

    def _window(self, name: str) -> _Window:
        if name not in self._windows:
            raise KeyError(
                f"MemoryMeter: no window {name!r} was measured (windows: {sorted(self._windows)})"
            )
        return self._windows[name]

    def _read(self, recorded: Iterable[Allocation | Range]) -> None:
        """The bytes held after each allocation event (allocations made while measuring,
        minus their frees) and the windows' time ranges."""
        allocations: list[Allocation] = []
        for event in recorded:
            if isinstance(event, Allocation):
                allocations.append(event)
            else:
                self._windows[event.name[len(_PREFIX) :]] = _Window(event.start_ns, event.end_ns)
        allocations.sort(key=lambda e: e[0])
        live: dict[int, int] = {}  # address -> bytes, of blocks allocated while measuring
        held = 0
        for t, nbytes, ptr in allocations:
            if nbytes > 0:  # (an address given out again was freed, seen or not: by a thread
                held += nbytes - live.get(ptr, 0)  # the profiler does not watch, say)
                live[ptr] = nbytes
            else:  # (a block allocated before the meter started is not counted when freed)
                held -= live.pop(ptr, 0)
            self._series.append((t, held))
