"""`assert_matches_single_device`: compare a (simulated or real) parallel result with the
single-device run, rank by rank, with float32 tolerances by default."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardwise.communication import _sim


def _this_rank() -> int:
    """This process's rank in a real job (0 without one)."""
    from shardwise import communication as comm

    return comm.get_rank() if comm.is_initialized() else 0


def _ranks_of(t: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    sim = _sim.current()
    if sim is None:  # (a per-rank tensor kept from a world that has ended: each rank's value)
        from shardwise.testing._world import parts_of

        parts = parts_of(t)
        return [(None, t)] if parts is None else [(r, v) for r, v in parts]
    return list(enumerate(sim.local_tensors(t)))


def _per_rank(expected: Any) -> dict[int | None, torch.Tensor]:
    """Each rank's value of an `expected` that holds one per rank (``world.rows(w)``); empty
    for a plain tensor, the same on every rank."""
    if not isinstance(expected, torch.Tensor):
        return {}
    parts = _ranks_of(expected)
    return {} if len(parts) == 1 and parts[0][0] is None else dict(parts)


def _outside() -> Any:
    from shardwise.testing._world import current_world

    world = current_world()
    return world.outside() if world is not None else contextlib.nullcontext()


def assert_matches_single_device(
    actual: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    what: str = "value",
) -> None:
    """Assert that a parallel result equals the single-device one on every rank.

    Args:
        actual: a tensor (per-rank inside `simulated_world`), or a dict / list / tuple of them.
        expected: the same structure of plain tensors (every rank must match), or a callable
            ``rank -> expected tensor`` for results that differ per rank (shards), called with
            each simulated rank, or with this process's rank in a real job; in a simulated
            world also a per-rank tensor (``world.rows(want)``): each rank's own value.
        rtol: relative tolerance (1e-5: float32 parity).
        atol: absolute tolerance for values near zero.
        what: a name used in the failure message.

    Raises:
        AssertionError: naming the entry, the rank and the element furthest past the tolerance.

    Example:
        >>> assert_matches_single_device(parallel_grads, single_grads, what="grads")
    """
    if isinstance(actual, Mapping):
        assert isinstance(expected, Mapping), f"{what}: expected a mapping"
        assert set(actual) == set(expected), f"{what}: keys {set(actual)} != {set(expected)}"
        for k in actual:
            assert_matches_single_device(
                actual[k], expected[k], rtol=rtol, atol=atol, what=f"{what}[{k!r}]"
            )
        return
    if isinstance(actual, Sequence) and not isinstance(actual, torch.Tensor):
        assert isinstance(expected, Sequence), f"{what}: expected a sequence"
        assert len(actual) == len(expected), f"{what}: {len(actual)} entries != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_matches_single_device(a, e, rtol=rtol, atol=atol, what=f"{what}[{i}]")
        return
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual)}"
    per_rank = _per_rank(expected)
    for rank, value in _ranks_of(actual):
        here = rank if rank is not None else _this_rank()
        want = expected(here) if callable(expected) else per_rank.get(here, expected)
        where = what if rank is None else f"{what} on rank {rank}"
        with _outside():
            _compare(value, want, rtol, atol, where)


def _compare(value: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, where: str) -> None:
    assert tuple(value.shape) == tuple(want.shape), (
        f"{where}: shape {list(value.shape)} != single-device {list(want.shape)}"
    )
    if value.is_complex() or want.is_complex():
        _compare_complex(value, want, rtol, atol, where)
        return
    v, w = value.detach().double().cpu(), want.detach().double().cpu()
    if torch.allclose(v, w, rtol=rtol, atol=atol, equal_nan=True):
        return
    i = _worst(v, w, rtol, atol)
    raise AssertionError(
        f"{where}: differs from single-device (rtol={rtol}, atol={atol}); worst difference "
        f"{float((v - w).abs().flatten()[i]):.3g} at flat index {i}: "
        f"{float(v.flatten()[i])!r} vs {float(w.flatten()[i])!r}"
    )


def _compare_complex(
    value: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, where: str
) -> None:
    """`_compare` where a side is complex: the real and the imaginary parts each within the
    tolerances (complex128's real view; a real side has imaginary parts 0)."""
    v = torch.view_as_real(value.detach().cpu().to(torch.complex128).resolve_conj())
    w = torch.view_as_real(want.detach().cpu().to(torch.complex128).resolve_conj())
    if torch.allclose(v, w, rtol=rtol, atol=atol, equal_nan=True):
        return
    i = _worst(v, w, rtol, atol)
    part = "imaginary" if i % 2 else "real"
    a, b = value.detach().flatten()[i // 2].item(), want.detach().flatten()[i // 2].item()
    raise AssertionError(
        f"{where}: differs from single-device (rtol={rtol}, atol={atol}); worst difference "
        f"{float((v - w).abs().flatten()[i]):.3g} in the {part} part at flat index {i // 2}: "
        f"{a!r} vs {b!r}"
    )


def _worst(v: torch.Tensor, w: torch.Tensor, rtol: float, atol: float) -> int:
    """The flat index of the element of `v` furthest past the tolerance from `w` (NaN: past)."""
    over = ((v - w).abs() - (atol + rtol * w.abs())).nan_to_num(nan=float("inf"))
    return int(over.argmax())


ExpectedFn = Callable[[int], torch.Tensor]
