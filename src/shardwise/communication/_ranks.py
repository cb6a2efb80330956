"""Rank-dependent values and groups, asked the same way whoever runs the ranks.

In a job each process runs one rank. Under `shardwise.testing.simulated_world(n)` one process
runs all n ranks at once: a tensor holds one value per rank and `get_rank()` is a per-rank
symbolic int. Code outside this package asks these functions instead of asking which case it
is in, so tests run the code that real jobs run:

- `process_ranks`: the global ranks whose work this process does (its own rank in a job).
- `holds_several_ranks`: whether this process does the work of more than one rank.
- `rank_value`: ``make(rank)`` for this rank: an int, a tensor, or a dict / list / tuple of
  them, computed for each rank the process runs (a per-rank value when it runs several).
- `own_group`: this rank's group among the groups ``members_of(r)`` that partition the ranks
  (in a simulated world rank 0's group, which stands for its translates).
- `rank_parts`: the plain tensors holding a tensor's value on the ranks the process runs
  (for storage-level work: data pointers, freeing and refilling storage).
- `file_rank`: the rank and world size that name the files this process writes itself.
- `shared_value`: a tensor's one value for such a file, None when the ranks the process runs
  hold different values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardwise._equal import same_values
from shardwise.communication import _init, _sim

T = TypeVar("T")


def process_ranks() -> tuple[int, ...]:
    """The global ranks whose work this process does.

    Returns:
        ``(rank,)`` in a job (one rank per process); every rank ``0 .. n-1`` in
        ``simulated_world(n)``; ``(0,)`` outside any job (a lone process is rank 0 of a 1-rank
        job).

    Example:
        >>> if bucket.root not in comm.process_ranks():
        ...     drop_gradients(bucket)   # another process updates this bucket
    """
    if not dist.is_initialized():
        return (0,)
    sim = _sim.current()
    if sim is not None:
        return tuple(range(sim.world_size))
    return (dist.get_rank(),)


def holds_several_ranks() -> bool:
    """Whether this process does the work of more than one rank at once.

    The one place to ask it: code that needs this process's single plain int rank (to pick a
    data shard, say), or that may share one object between ranks only when the process runs
    one, asks this instead of counting `process_ranks`. Prefer `rank_value`, which needs no
    such branch, where it fits.

    Returns:
        False in a job (one rank per process) and outside any job; True under
        ``simulated_world(n)`` with n > 1 (every rank in this process).

    Example:
        >>> if comm.holds_several_ranks():
        ...     raise ValueError("pass shard_id explicitly")   # no single rank to read
    """
    return len(process_ranks()) > 1


def rank_value(make: Callable[[int], T]) -> T:
    """``make(rank)`` for this process's global rank, as a rank-dependent value.

    In a job this is ``make(get_rank())``. Where one process runs every rank (simulated world)
    `make` runs once per rank, with plain tensors (outside the per-rank mode: a random draw
    happens once per call, from that rank's random stream, which it advances as on rank r's
    process: weights a call initializes leave every rank's generator where the job's processes
    leave theirs), and the results are joined: tensors into one
    per-rank tensor, ints that differ into a per-rank int, dicts / lists / tuples item by item
    (of the same keys / length on every rank); anything else must be equal on every rank.

    Args:
        make: computes rank r's value from its global rank r.

    Returns:
        This rank's value (per-rank where ranks differ).

    Raises:
        RuntimeError: no job (call `init()` first).
        ValueError: (several ranks per process) values other than ints and tensors that differ
            between ranks, or a structure that does (a list's length, a dict's keys, a type).

    Example:
        >>> coord = rank_value(lambda r: matrix.coord(r)[axis])   # this rank's coordinate
        >>> block = x.narrow(0, coord * rows, rows)
    """
    sim = _sim.current()
    if sim is None:
        return make(_init.get_rank())
    values = sim.each_rank(make)
    joined: T = _join(sim, values, "rank_value")
    return joined


def _join(sim: _sim.Simulator, values: list[Any], where: str) -> Any:
    first = values[0]
    _check_same_kind(values, where)
    if isinstance(first, torch.Tensor):
        return sim.from_local_tensors(values)
    if isinstance(first, int) and not isinstance(first, bool):
        return first if all(v == first for v in values) else sim.per_rank_int(values)
    if isinstance(first, dict):
        return {k: _join(sim, [v[k] for v in values], f"{where}[{k!r}]") for k in first}
    if isinstance(first, list | tuple):
        items = [_join(sim, [v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
        return type(first)(items)
    if any(v != first for v in values):
        raise ValueError(
            f"{where}: the ranks give different values of type {type(first).__name__}; only "
            "ints and tensors may differ between ranks"
        )
    return first


def _check_same_kind(values: list[Any], where: str) -> None:
    """Refuse values whose structure differs between ranks, which one joined value cannot hold
    (a list of each rank's length, a dict of each rank's keys): the kind (tensor, int, dict,
    list, tuple), a list's or tuple's length and a dict's keys must be rank 0's on every rank."""
    first = values[0]
    if not isinstance(first, dict | list | tuple | torch.Tensor | int) or isinstance(first, bool):
        return  # (other values must be equal on every rank: `_join` compares them)
    for r, v in enumerate(values[1:], start=1):
        if _structure(v) != _structure(first):
            raise ValueError(
                f"{where}: rank 0 gives {_described(first)} and rank {r} {_described(v)}; only "
                "ints and tensors may differ between ranks, not the structure around them "
                "(list lengths, dict keys, types): give every rank a value of the same shape "
                "(pad the lists, give every dict every key), or run the code in a real job"
            )


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "tensor"
    return "int" if isinstance(v, int) and not isinstance(v, bool) else type(v).__name__


def _structure(v: Any) -> tuple[Any, ...]:
    """What must be alike on every rank: the kind, a dict's keys (in any order), a list's or
    tuple's length."""
    if isinstance(v, dict):
        return ("dict", frozenset(v))
    return (_kind(v), len(v)) if isinstance(v, list | tuple) else (_kind(v),)


def _described(v: Any) -> str:
    """`v`'s `_structure` in words."""
    if isinstance(v, dict):
        return f"a dict of keys {list(v)}" if set(v) else "an empty dict"
    if isinstance(v, list | tuple):
        return f"a {type(v).__name__} of length {len(v)}"
    return f"an {_kind(v)}" if _kind(v) == "int" else f"a {_kind(v)}"


def own_group(members_of: Callable[[int], Sequence[int]]) -> tuple[int, ...]:
    """This rank's group, among the groups ``members_of(r)`` (global ranks, in the caller's
    order) that partition the ranks.

    In a job this is ``members_of(get_rank())``. Where one process runs every rank (simulated
    world) a collective on a group runs on all its translates at once, so every rank's group
    must be rank 0's shifted (the same order), and rank 0's group is returned for all.

    Args:
        members_of: rank r's group, r among it.

    Returns:
        The members, in the order `members_of` gives them.

    Raises:
        RuntimeError: no job (call `init()` first).
        ValueError: (several ranks per process) a rank's group is not a translate of rank 0's.

    Example:
        >>> ranks = own_group(lambda r: matrix.group_along(r, (axis,)))
        >>> name = ensure_group(scoped_group_name("tp", str(matrix), ranks), ranks)
    """
    sim = _sim.current()
    if sim is None:
        return tuple(members_of(_init.get_rank()))
    first = tuple(members_of(0))
    for r in range(1, sim.world_size):
        got = tuple(members_of(r))
        shift = min(got) - min(first)
        if got != tuple(m + shift for m in first):
            raise ValueError(
                f"rank {r}'s group {list(got)} is not rank 0's group {list(first)} shifted: "
                f"in simulated_world({sim.world_size}) a collective runs on a group and all its "
                "translates at once, so the groups must tile the world like a mesh axis (for "
                "a device matrix: use the default rank_list over the whole world)"
            )
    return first


def rank_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s value on the ranks this process runs, in rank order
    (`t` itself in a job; one per rank in a simulated world). For storage-level work (data
    pointers, ``untyped_storage().resize_``); compute on `t` itself.

    Example:
        >>> for part in rank_parts(leaf):
        ...     part.untyped_storage().resize_(0)   # free the gathered weight
    """
    sim = _sim.current()
    return [t] if sim is None else sim.local_tensors(t)


def file_rank() -> tuple[int, int]:
    """``(rank, world size)`` naming the files this process writes for itself (e.g.
    ``directory/rank_<rank>`` checkpoints when the size is above 1).

    Returns:
        This process's rank and the world size in a job; ``(0, 1)`` outside a job and where one
        process runs every rank (simulated world: one set of files for the whole job).

    Example:
        >>> rank, size = file_rank()
        >>> manager = CheckpointManager("ckpt", rank=rank, world_size=size)
    """
    if not dist.is_initialized() or _sim.current() is not None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shared_value(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s value as one plain tensor when every rank this process runs holds the same value
    (what a file this process writes for all of them may store: `file_rank`); None when they
    differ.

    Returns:
        `t` itself in a job (one rank per process) and outside one; in a simulated world the
        common value of every rank, or None when two ranks differ (a block of a split
        parameter, optimizer state kept on its owner rank only).

    Example:
        >>> value = shared_value(p.detach())
        >>> if value is None:
        ...     raise ValueError("each rank holds its own block: write one file per rank")
    """
    parts = rank_parts(t)
    first = parts[0]
    return first if all(same_values(other, first) for other in parts[1:]) else None


def first_claim(key: str, value: str) -> str:
    """The value the job's first rank to claim `key` gave (`value` when it is this one): a
    choice every rank makes alike without waiting for the others (no collective: a rank that
    never claims `key` holds no one up), through the job's store. `value` itself outside a job,
    in a simulated world (one process) and in a dry run (`dry_run`: no store behind).

    Example:
        >>> prefix = first_claim("ckpt_prefix/ckpt/m/0", "m_1")
    """
    if file_rank()[1] == 1 or dist.get_backend() == "fake":  # (one process; a dry run)
        return value
    from shardwise._torch.c10d import default_store

    store = default_store()
    return bytes(store.compare_set(f"shardwise/claim/{key}", "", value)).decode()
