"""Join the job and manage named groups.

`init()` reads the job from the launcher's environment (`_env.detect_job`), builds the
rendezvous store and the default process group; `get_rank`, `get_group_size`,
`get_local_rank` answer questions about it; `create_group` / `destroy_group` keep a registry of
named sub-groups (MindSpore style); `release()` tears everything down. Under `shardwise run`
`init()` also opens the collective trace (`_trace.open_trace`). A script that never
calls `release()` leaves the job the same way at interpreter exit (`_exit.install`, registered
by `init()`; `leave_at_exit` is its barrier-with-a-bound and teardown).

Under `shardwise.testing.simulated_world(n)` the default group already exists (a fake one) and
`get_rank()` returns a per-rank symbolic int, so rank-dependent code such as
``x[rank * k:(rank + 1) * k]`` slices each simulated rank's own part.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise._torch.c10d import default_store
from shardwise.communication import _exit, _sim, _trace
from shardwise.communication._backend import check_backend
from shardwise.communication._env import JobEnv, detect_job
from shardwise.communication._netif import socket_ifname_env
from shardwise.communication._store_sync import (
    agree_on_group,
    comm_timeout,
    store_barrier,
)

WORLD_COMM_GROUP = "world_group"
_WORLD_ALIASES = frozenset({WORLD_COMM_GROUP, "hccl_world_group", "nccl_world_group"})


@dataclass(frozen=True)
class Group:
    """A named communication group: its global ranks and the torch process group."""

    name: str
    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None  # None means the default (world) group

    def __str__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


_groups: dict[str, Group] = {}
_job: JobEnv | None = None
_joins = 0  # multi-rank init() calls so far (the same count on every rank)
_made: dict[tuple[str, tuple[int, ...]], int] = {}  # (create_group calls per name and ranks)


def init(backend: str | None = None) -> None:
    """Join the distributed job (idempotent).

    The process leaves the job cleanly at exit even without `release()`: a script that ends
    normally (or by ``sys.exit(0)``) waits at most 10 s for the other ranks to end too, then
    tears its process groups down before the interpreter does; a script that raises (or calls
    ``sys.exit`` with a non-zero code) leaves at once, waits for nobody, and its traceback is
    the job's root cause. Under ``shardwise run`` it also
    traces which collective it is in, for the launcher's report of a hang. In a job of several
    ranks whose script has not seeded torch, every rank takes rank 0's torch random state
    (networks built after ``init()`` start alike on every rank; `context.torch_seeded`).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or None for the default
            (`default_backend()`).

    Raises:
        LaunchEnvError: the launcher's environment is incomplete; the message names the variable.
        ValueError: unknown backend, or one this torch/machine lacks (``"nccl"`` without
            CUDA): `_backend.check_backend`.

    Example:
        >>> import shardwise as sw
        >>> sw.communication.init()      # a plain `python script.py` is a 1-rank job
        >>> sw.communication.get_group_size()
        1
    """
    global _job
    if dist.is_initialized():
        return
    backend = check_backend(backend or None)
    job = detect_job()
    timeout = comm_timeout()
    store: Any
    if job.world_size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
    else:
        # torchrun and `shardwise run` host the store in the launcher; otherwise rank 0 does.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(  # type: ignore[attr-defined]
            job.master_addr,
            job.master_port,
            job.world_size,
            is_master=job.rank == 0 and not agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
        store = _join_store(store)
        # the interface that reaches the master, unless GLOO_SOCKET_IFNAME is set
        os.environ.update(socket_ifname_env(job.master_addr, os.environ))
    if backend == "nccl":
        torch.cuda.set_device(job.local_rank)
    dist.init_process_group(
        backend, store=store, rank=job.rank, world_size=job.world_size, timeout=timeout
    )
    if job.world_size > 1:
        _same_seed(store, job.rank)
    _job = job
    _exit.install()
    if job.world_size > 1:
        _trace.open_trace()


def _join_store(store: Any) -> Any:
    """The store a multi-rank `init()` makes its process group with: the launcher's under
    ``job/<run id>`` (under torchrun or `shardwise run`), and a fresh prefix for each `init()`
    after a `release()` (``.../init<n>``). The launcher's store outlives a `release()`, and
    the new world group takes the same name as the last one (torch counts groups from 0 again):
    its ranks would read the addresses the last one left there, and connect to ports gone
    ("Connection refused" in ``init()``, "Connection reset by peer" in the first collective, or
    a hang)."""
    global _joins
    _joins += 1
    prefix = os.environ.get("SHARDWISE_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    prefix = f"job/{prefix}" if prefix else ""
    if _joins > 1:
        prefix = f"{prefix}/init{_joins}" if prefix else f"init{_joins}"
    return dist.PrefixStore(prefix, store) if prefix else store  # type: ignore[attr-defined]


def _same_seed(store: Any, rank: int) -> None:
    """A script that has not seeded torch (`context.torch_seeded`) takes rank 0's torch random
    state on every rank, through the job's store (no collective; rank 0's own stream goes on
    as it was): each process drew its own seed, so networks built after ``init()`` would start
    from other weights on every rank, and with averaged gradients train different replicas for
    ever. Every rank then reads as seeded or not as rank 0 does (`context.take_random_start`: a
    dataset of an unseeded script takes MindSpore's constant default seed on every rank
    alike)."""
    from shardwise.context import random_start, take_random_start, torch_seeded

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # (a restarted job's own key)
    key = f"shardwise/random_start/{attempt}"  # (rank 0 always writes it: none waits for naught)
    if rank == 0:
        state, at_import = random_start()
        store.set(key, str(at_import).encode() + b":" + bytes(state.numpy()))
    elif not torch_seeded():
        head, _, tail = bytes(store.get(key)).partition(b":")
        raw = torch.frombuffer(bytearray(tail), dtype=torch.uint8).clone()
        take_random_start(raw, int(head))


def is_initialized() -> bool:
    """Whether a default process group exists (real or simulated)."""
    return dist.is_initialized()


def _require_init(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: no job yet; call shardwise.communication.init() first")


def resolve_group(group: str | Group | None) -> Group:
    """The `Group` for a name, a `Group` or None (the world group).

    Raises:
        ValueError: an unknown group name; the message lists the known ones.
    """
    _require_init("the collectives and get_rank() / get_group_size()")
    if isinstance(group, Group):
        return group
    if group is None or group in _WORLD_ALIASES:
        return Group(WORLD_COMM_GROUP, tuple(range(dist.get_world_size())), None)
    if group not in _groups:
        known = ", ".join(sorted(_groups)) or "none"
        raise ValueError(
            f"unknown group {group!r} on this rank: create it with "
            f"create_group() on each of its members first (a rank outside the group cannot "
            f"call its collectives: guard the call with `if rank in rank_ids`); known: {known}"
        )
    return _groups[group]


def get_rank(group: str | Group | None = None) -> int:
    """This process's rank in `group` (the world group when None).

    Under `simulated_world(n)` this is a symbolic int that takes each rank's value.
    """
    g = resolve_group(group)
    sim = _sim.current()
    if sim is not None:
        return sim.rank_in(g.ranks)
    rank = dist.get_rank()
    if rank not in g.ranks:
        raise ValueError(f"get_rank(group={g.name!r}): rank {rank} is not a member of {g}")
    return g.ranks.index(rank)


def get_group_size(group: str | Group | None = None) -> int:
    """Number of ranks in `group` (the world group when None)."""
    return len(resolve_group(group).ranks)


def get_local_rank() -> int:
    """Rank of this process on its node (0 in a 1-rank job or a simulated world)."""
    _require_init("get_local_rank")
    return _job.local_rank if _job is not None else 0


def scoped_group_name(tag: str, scope: str, ranks: Sequence[int]) -> str:
    """A group name the same on every rank: ``<tag>@<8 hex of sha1(scope)>:<sorted ranks>``.

    `scope` is what the group belongs to (a plan's device matrix, as text): every rank of it
    then creates its groups at the same steps, in the same order (torch's member-only group
    names count the groups a process has made).

    Example:
        >>> scoped_group_name("parallel:g1", str(matrix), [0, 1])
        'parallel:g1@1a2b3c4d:0-1'
    """
    digest = hashlib.sha1(scope.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{tag}@{digest}:{'-'.join(str(r) for r in sorted(ranks))}"


def ensure_group(name: str, ranks: Sequence[int]) -> str:
    """The group `name` of `ranks`, created on first use (`create_group`); returns `name`."""
    try:
        get_group_size(name)
    except ValueError:
        create_group(name, list(ranks))
    return name


def create_group(name: str, rank_ids: list[int] | tuple[int, ...]) -> Group:
    """Create a named group of global ranks (called by the members only, as in MindSpore).

    Args:
        name: the group's name; must not exist yet.
        rank_ids: distinct global ranks, each in ``[0, world_size)`` (one rank is allowed).

    Returns:
        The new `Group`; collectives accept the name or the object.

    Raises:
        ValueError: empty/duplicate/out-of-range rank ids, a taken name, or (with real processes)
            the calling rank not in `rank_ids`, or the members holding different numbers of
            groups (one made a one-rank group the others did not make, say): torch names a
            member-only group by its ranks and that count, and its members meet under that
            name, so create groups in the same order and number on every member (one-rank
            groups on every rank, or after the groups they share).
        RuntimeError: (a job) a member did not call create_group for it within
            `comm_timeout()`.

    Example:
        >>> g = create_group("pairs", [0, 1])   # on ranks 0 and 1
        >>> sw.ops.AllReduce(group="pairs")(x)
    """
    _require_init("create_group")
    world = dist.get_world_size()
    if not isinstance(name, str) or not name or name in _WORLD_ALIASES:
        raise ValueError(f"create_group: name {name!r} must be a new, non-empty string")
    if name in _groups:
        raise ValueError(f"create_group: a group named {name!r} exists: {_groups[name]}")
    ids = list(rank_ids)
    if any(isinstance(r, torch.SymInt) for r in ids):
        raise ValueError(
            f"create_group({name!r}): rank_ids hold per-rank ints (each rank's own group, "
            "as rank_value gives it): pass this rank's group as one list of ints "
            "with communication.own_group(lambda r: <rank r's group>)"
        )
    if not ids or not all(isinstance(r, int) and not isinstance(r, bool) for r in ids):
        raise ValueError(
            f"create_group({name!r}): rank_ids must be a non-empty list of ints, got {rank_ids!r}"
        )
    bad = [r for r in ids if not 0 <= r < world]
    if bad:
        raise ValueError(f"create_group({name!r}): rank_ids {bad} are outside [0, {world})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"create_group({name!r}): rank_ids {ids} contain duplicates")
    sim = _sim.current()
    if sim is not None:
        pg = sim.new_group(name, sorted(ids))
    else:
        if dist.get_rank() not in ids:
            raise ValueError(
                f"create_group({name!r}): rank {dist.get_rank()} is not in rank_ids {ids}; "
                "only the members call create_group"
            )
        pg = _member_group(name, sorted(ids))
    group = Group(name, tuple(sorted(ids)), pg)
    _groups[name] = group
    return group


def _member_group(name: str, ids: list[int]) -> dist.ProcessGroup:
    """The torch process group of `create_group` in a job: its members first check that torch
    names it alike on each of them (`agree_on_group`), then create it."""
    if len(ids) > 1 and dist.get_backend() != "fake":  # (a dry run: one rank, no store)
        made = _made[name, tuple(ids)] = _made.get((name, tuple(ids)), 0) + 1
        key = f"shardwise/group/{name}/{'-'.join(map(str, ids))}/{made}"
        agree_on_group(default_store(), key, name, ids, dist.get_rank())
    try:
        pg: dist.ProcessGroup = dist.new_group(
            ids, timeout=comm_timeout(), use_local_synchronization=True
        )
    except dist.DistStoreError as e:
        raise RuntimeError(
            f"create_group({name!r}, {ids}): the members did not all connect within "
            f"{comm_timeout().total_seconds():g} s (SHARDWISE_COMM_TIMEOUT); every member "
            "calls create_group with the same name and rank_ids, having created the same "
            "groups before it; see the other members' logs"
        ) from e
    return pg


def destroy_group(name: str) -> None:
    """Destroy a group made by `create_group`.

    Raises:
        ValueError: the world group or an unknown name.
    """
    if name in _WORLD_ALIASES:
        raise ValueError("destroy_group: the world group is destroyed by release()")
    if name not in _groups:
        raise ValueError(f"destroy_group: no group named {name!r}")
    group = _groups.pop(name)
    if group.pg is not None and _sim.current() is None:
        dist.destroy_process_group(group.pg)


def forget_groups() -> None:
    """Drop the registry of named groups without touching process groups (simulated worlds)."""
    _groups.clear()


def release() -> None:
    """Leave the job: wait for every rank, destroy every group and the default process group
    (idempotent). Optional: `init()` makes the process do the same at exit, with a bounded
    wait."""
    _leave(bounded=False)


def leave_at_exit() -> None:
    """`release()` for interpreter exit: the barrier gives up after `_exit.exit_wait` (the ranks
    still missing are busy elsewhere or gone, and no collective of this rank is in flight), then
    the process groups are destroyed all the same."""
    _leave(bounded=True)


def _leave(bounded: bool) -> None:
    """The teardown of `release` and `leave_at_exit`: the store barrier (`bounded`: at most
    `_exit.exit_wait`, and a barrier that fails or finds no store is given up), then destroy."""
    global _job
    _groups.clear()
    if dist.is_initialized() and _sim.current() is None:
        if dist.get_world_size() > 1:
            if not bounded:
                _store_barrier()
            else:  # (late peers, or the store is gone: given up)
                with contextlib.suppress(RuntimeError, ValueError):
                    _store_barrier(_exit.exit_wait(comm_timeout()), fallback=False)
        dist.destroy_process_group()
    _trace.close_trace()
    _job = None


_releases = 0  # release() calls so far (the same count on every rank)


def _store_barrier(timeout: datetime.timedelta | None = None, fallback: bool = True) -> None:
    """Wait until every rank has reached `release` (or the exit), through the rendezvous store,
    each wait at most `timeout` (default `comm_timeout()`); without a store to use, the plain
    barrier (`fallback`) or none.

    Not ``dist.barrier()``: on torch 2.13 a gloo work object carries the caller's Python
    context (``contextvars``), and the barrier's is freed by a gloo worker thread a moment
    after ``wait()`` returns; when that happens during interpreter shutdown the worker cannot
    take the GIL and the process aborts ("terminate called without an active exception",
    about 1 job in 20-40 here). Store calls run on this thread and leave no such object.
    """
    global _releases
    _releases += 1
    try:
        store = default_store()
    except (AttributeError, RuntimeError, ValueError):  # no store to use: the plain barrier
        if fallback:
            dist.barrier()
        return
    key = f"shardwise/release/{_releases}"
    store_barrier(store, key, dist.get_rank(), dist.get_world_size(), timeout)
