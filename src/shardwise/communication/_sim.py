"""The hook through which a simulated world (all ranks in one process) plugs in.

`shardwise.testing.simulated_world` installs a `Simulator` with `install()`; the communication
layer asks `current()` and, when one is active, lets it answer what a single process cannot
know by itself: each rank's rank, which sub-groups exist, and point-to-point exchanges between
simulated ranks. The simulation's private torch imports stay in `shardwise.testing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Simulator(Protocol):
    """What the communication layer needs from a simulated world."""

    world_size: int

    def rank_in(self, ranks: Sequence[int]) -> int:
        """Each simulated rank's index in `ranks` (a per-rank symbolic int)."""
        ...

    def tiles(self, ranks: Sequence[int]) -> list[list[int]]:
        """The translates of `ranks` that partition the world (each runs the collective)."""
        ...

    def new_group(self, name: str, ranks: Sequence[int]) -> dist.ProcessGroup:
        """A process group on which collectives run for `ranks` and its translates that tile
        the world; a ValueError naming group `name` when `ranks` is not one of them."""
        ...

    def copy_of(self, rank: int, ranks: Sequence[int]) -> list[int]:
        """The translate of the group `ranks` (one of `tiles`) that `rank` runs."""
        ...

    def values(self, value: Any) -> list[Any]:
        """`value` as seen by each rank: per-rank ints resolve, other values repeat."""
        ...

    def local_tensors(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's local value of `t`."""
        ...

    def per_rank_int(self, values: Sequence[int]) -> int:
        """A symbolic int equal to ``values[r]`` on rank r."""
        ...

    def rank_map(self, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """One tensor whose value on rank r is ``fn(r)``."""
        ...

    def draw_same(self, draw: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `draw` once and give its value to every rank; the random stream of every rank
        advances as the draw did (see `replicated_draw`)."""
        ...

    def outside(self) -> AbstractContextManager[Any]:
        """A context in which tensors are plain (no per-rank values, one RNG draw)."""
        ...

    def each_rank(self, make: Callable[[int], Any]) -> list[Any]:
        """``make(r)`` for every rank r with plain tensors (`outside`), each call drawing from
        rank r's random stream and advancing it, as rank r's process would."""
        ...

    def every_rank(self, t: torch.Tensor, copies: bool = False) -> torch.Tensor:
        """`t` as a value of every rank (a plain tensor made one per-rank tensor; `copies`:
        each rank its own copy)."""
        ...

    def draw_state(self) -> Any:
        """The state of the generator `draw_same` draws from."""
        ...

    def set_draw_state(self, state: Any) -> None:
        """Put back a state `draw_state` returned."""
        ...

    def from_local_tensors(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """One tensor holding `parts[r]` on rank r."""
        ...

    def exchange(
        self,
        kind: str,
        sends: Sequence[torch.Tensor],
        send_to: Sequence[tuple[int, int]],
        recv_from: Sequence[tuple[int, int]],
        recv_shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        group: Sequence[int],
    ) -> tuple[list[torch.Tensor], int]:
        """Point-to-point between simulated ranks; peers are (global rank or -1, tag) pairs,
        each possibly per-rank. Returns the received tensors and the most bytes any rank sent.
        """
        ...


_current: Simulator | None = None


def current() -> Simulator | None:
    """The active simulator, or None in a real (or 1-rank) job."""
    return _current


def install(sim: Simulator | None) -> Simulator | None:
    """Make `sim` the active simulator; returns the previous one."""
    global _current
    prev, _current = _current, sim
    return prev


def plain_tensors() -> AbstractContextManager[Any]:
    """A context in which tensors are plain, one value for the whole job (no per-rank values):
    capture and planning run in it. In a real job it does nothing.

    Example:
        >>> with plain_tensors():
        ...     graph = capture(model, ids, ids)
    """
    sim = current()
    return sim.outside() if sim is not None else contextlib.nullcontext()


def replicated_draw(draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A random tensor that every rank draws identically (e.g. a global dropout mask).

    In a real job `draw()` simply runs on each rank: with the same seed on every rank
    (``sw.set_seed``) the global generators agree, so the value is the same everywhere and the
    generator advances exactly as in a single-device run. In a simulated world random factories
    would draw once per rank, so the value is drawn once outside the simulation and handed to
    every rank.

    Args:
        draw: makes the tensor (e.g. ``lambda: torch.rand(shape)``).

    Returns:
        The drawn tensor, the same value on every rank.

    Example:
        >>> noise = replicated_draw(lambda: torch.rand(8, 16))
    """
    sim = _current
    return draw() if sim is None else sim.draw_same(draw)


def draw_state() -> Any:
    """The state of the random generators `replicated_draw` draws from (in a job: the CPU's, and
    CUDA's when it is initialized), to draw the same values again later (`set_draw_state`: an
    activation checkpoint's recomputation).

    Example:
        >>> state = draw_state()
        >>> set_draw_state(state)
    """
    sim = _current
    if sim is not None:
        return sim.draw_state()
    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), devices


def set_draw_state(state: Any) -> None:
    """Put back a state `draw_state` returned."""
    sim = _current
    if sim is not None:
        sim.set_draw_state(state)
        return
    cpu, devices = state
    torch.set_rng_state(cpu)
    if devices is not None:
        torch.cuda.set_rng_state_all(devices)


def process_rng_state() -> dict[str, torch.Tensor] | None:
    """This process's random generators' states, for a checkpoint to continue a run's random
    draws (dropout) where it stopped: ``{"cpu": ..., "cuda.<i>": ...}`` (CUDA's when it is
    initialized); None in a simulated world, whose ranks draw from generators of their own.

    Example:
        >>> states = process_rng_state()
        >>> set_process_rng_state(states)
    """
    if _current is not None:
        return None
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        states.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def set_process_rng_state(states: dict[str, torch.Tensor]) -> None:
    """Put back the states `process_rng_state` returned (CUDA's where this process has those
    devices); nothing in a simulated world."""
    if _current is not None:
        return
    torch.set_rng_state(states["cpu"])
    cuda = sorted((int(k.split(".")[1]), v) for k, v in states.items() if k.startswith("cuda."))
    devices = [v for _, v in cuda]
    if devices and torch.cuda.is_available() and len(devices) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(devices)


def every_rank(t: torch.Tensor, copies: bool = False) -> torch.Tensor:
    """`t` as a value every rank holds: itself in a job; in a simulated world a plain tensor
    (a constant the step made, ``torch.tensor([...])``) becomes a per-rank one, so that a
    rank-dependent slice of it (`redistribution`) takes each rank's part.

    Args:
        t: the tensor.
        copies: the ranks update the value apart (optimizer state, a loaded parameter): in a
            simulated world each rank gets its own copy (rank 0 keeps `t`), not views of one.

    Returns:
        `t` in a job; in a simulated world the per-rank tensor (`t` itself if it is one).

    Example:
        >>> block = every_rank(mask).narrow(0, coord * rows, rows)
    """
    sim = _current
    return t if sim is None else sim.every_rank(t, copies)
