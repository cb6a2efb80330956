"""Checks that the ranks of a job agree, made once per plan through the job's store (no
collective, no device memory), with the same answer on every rank:

- `ranks_unlike_leader`: the ranks whose value of a tensor differs from their leader rank's
  (inputs every rank passes alike).
- `agree_with_ranks`: that check together with two more in the same store round: whether each
  rank's description of a decision (a plan, as text) is rank 0's, and whether some rank failed
  to make it (its message), so that ranks which diverged stop together with a message instead
  of waiting for each other in a collective.
- `announce_planning`: this rank is about to make a decision its ranks make only now and then
  (planning a call again for new input shapes), so the next `agree_with_ranks` first waits
  (`arrival_timeout`: half the collectives' timeout) for every rank's own announcement: ranks
  that kept their plan (they were passed other shapes) never plan, and would leave this rank
  waiting in the store while they wait in a collective until the timeout; instead
  `Agreement.absent` names them.

In a simulated world one process runs every rank: the values are compared directly, and the
decision is the same on every rank (one program makes it once).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise.communication import _sim
from shardwise.communication._store_sync import comm_timeout, wait_key

_next_check = 0  # (each rank makes the same checks in the same order: their keys)
_announced: int | None = None  # (the check this rank announced: `announce_planning`)

Leader = Callable[[int], int]
Named = Sequence[tuple[str, torch.Tensor, Leader]]


@dataclass(frozen=True)
class Unlike:
    """The answer of `ranks_unlike_leader`: `count` ranks passed some value unlike their
    leader's; `ranks` names them (in a job the first to report), `name` the first value that
    differs (in a job as the first reporting rank saw it); `leaders` maps each named rank to
    the leader it was compared with."""

    count: int = 0
    ranks: tuple[int, ...] = ()
    name: str = ""
    leaders: tuple[int, ...] = ()


@dataclass(frozen=True)
class Agreement:
    """The answer of `agree_with_ranks`: `unlike` as `ranks_unlike_leader` answers; `failed`:
    ``(rank, message)`` of the first rank to report that it failed (None: none did);
    `differs`: ``(rank, what)`` of the first rank to report a decision unlike rank 0's, `what`
    being its `describe` of the difference (None: every rank's is rank 0's, or some failed);
    `absent`: (a job, after `announce_planning`) the ranks that did not announce this check
    within `arrival_timeout`, the round then not made (the other fields empty)."""

    unlike: Unlike = Unlike()
    failed: tuple[int, str] | None = None
    differs: tuple[int, str] | None = None
    absent: tuple[int, ...] = ()


def arrival_timeout() -> datetime.timedelta:
    """How long a check announced with `announce_planning` waits for the other ranks'
    announcements: half of `comm_timeout()` (the ranks that never announce wait in a
    collective until `comm_timeout()`: this rank must fail with its message first; a rank
    merely behind, busy between two calls, has the other half as before)."""
    return comm_timeout() / 2


def announce_planning(inputs: str) -> None:
    """Tell the job's other ranks, through its store, that this rank is about to make its
    next check (`agree_with_ranks`) after a decision that not every rank may make (planning a
    call again for inputs of new shapes); `inputs` (this rank's inputs, as text) goes with it.
    That check first waits `arrival_timeout` for every rank's announcement, and answers with
    `Agreement.absent` naming the ranks that did not announce it. Does nothing outside a job, in
    a simulated world and in a dry run.

    Call it before the decision's own work (the ranks arrive together, but their work may last
    longer on some), every rank that makes the decision.
    """
    global _announced
    if not _in_job():
        return
    from shardwise._torch.c10d import default_store

    _announced = _next_check
    default_store().set(f"{_key(_next_check)}/planning/{dist.get_rank()}", inputs)


def ranks_unlike_leader(named: Named) -> Unlike:
    """Which ranks hold other values than their leader ranks do: for each ``(name, t,
    leader)``, this rank's `t` against the `t` of rank ``leader(rank)`` (a leader is its own
    leader), compared bitwise (dtype, shape and bytes). Every rank of the job calls it at the
    same point, and every rank gets the same answer.

    In a simulated world each rank's values are compared with its leaders' directly. In a job
    each rank writes digests of its values to the job's store under its rank, reads its
    leaders', and the ranks wait for each other's verdicts there (no collective, no device
    memory: for a check once per plan, not per step); ranks passing different numbers of values
    differ too.

    Returns:
        An `Unlike` (count 0 outside a job, in a dry run and when a value is a meta tensor).

    Raises:
        RuntimeError: (a job) some rank did not reach the check within the store's timeout.

    Example:
        >>> unlike = comm.ranks_unlike_leader([("batch", batch, lambda r: 0)])
        >>> if unlike.count:
        ...     raise ValueError(f"rank {unlike.ranks[0]} passed another batch than rank 0")
    """
    return agree_with_ranks(named, "", None, lambda _: "").unlike


def agree_with_ranks(
    named: Named, text: str, failure: str | None, describe: Callable[[str], str]
) -> Agreement:
    """`ranks_unlike_leader` of `named`, and in the same store round: whether this rank's
    `text` (its description of a decision every rank makes alike, e.g. a plan as JSON) is
    rank 0's, and whether some rank's `failure` (its message; None: it did not fail) was
    reported. Every rank of the job calls it at the same point, failed or not, and every rank
    gets the same answer.

    Args:
        named: the values compared with their leader ranks' (`ranks_unlike_leader`).
        text: this rank's decision (ignored where `failure` is set); ranks compare digests,
            rank 0 also stores the whole text.
        failure: this rank's error message when it could not make the decision.
        describe: run on the first rank whose `text` is not rank 0's, with rank 0's text: what
            differs (a short line; a raised error is replaced by a plain "differs").

    Returns:
        An `Agreement` (nothing found outside a job, in a simulated world, in a dry run and
        when a value is a meta tensor; after `announce_planning`, only `absent` when some rank
        did not announce this check).

    Raises:
        RuntimeError: (a job) some rank did not reach the check within the store's timeout.
    """
    global _next_check, _announced
    index, announced = _next_check, _announced == _next_check
    _next_check, _announced = index + 1, None
    if not dist.is_initialized() or any(t.is_meta for _, t, _ in named):
        return Agreement()
    sim = _sim.current()
    if sim is not None:
        return Agreement(_unlike_in_world(sim, named))
    if not _in_job():  # (a dry run: no values)
        return Agreement()
    try:
        if announced and (absent := _absent(_key(index))):
            return Agreement(absent=absent)
        return _agree_in_job(_key(index), named, text, failure, describe)
    except dist.DistStoreError as e:
        raise RuntimeError(
            f"comparing the ranks' {', '.join(n for n, _, _ in named) or 'plans'}: some rank did "
            f"not reach the check within the store's timeout (it stopped, called with other "
            f"inputs, or never made this call: every rank makes a wrapper's first call, or its "
            f"plan(), at the same point); see the other ranks' logs"
        ) from e


def _key(index: int) -> str:
    """The store key of check number `index` (per restart of the job)."""
    return f"shardwise/same/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{index}"


def _in_job() -> bool:
    """Whether this process is one rank of a job of several processes (not a simulated world,
    not a dry run)."""
    if not dist.is_initialized() or _sim.current() is not None:
        return False
    return dist.get_backend() != "fake" and dist.get_world_size() > 1


def _absent(key: str) -> tuple[int, ...]:
    """The ranks whose `announce_planning` of the check `key` did not come within
    `arrival_timeout` (counted from this call)."""
    from shardwise._torch.c10d import default_store

    store, world = default_store(), dist.get_world_size()
    deadline = time.monotonic() + arrival_timeout().total_seconds()
    for r in range(world):
        left = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(RuntimeError):  # (named below, with any other one missing)
            wait_key(store, f"{key}/planning/{r}", left)
    return tuple(r for r in range(world) if not store.check([f"{key}/planning/{r}"]))


def _unlike_in_world(sim: _sim.Simulator, named: Named) -> Unlike:
    ranks: dict[int, tuple[str, int]] = {}
    for name, t, leader in named:
        digests = [_digest(part) for part in sim.local_tensors(t)]
        for r, d in enumerate(digests):
            if d != digests[leader(r)] and r not in ranks:
                ranks[r] = (name, leader(r))
    order = sorted(ranks)
    first = ranks[order[0]][0] if order else ""
    return Unlike(len(order), tuple(order), first, tuple(ranks[r][1] for r in order))


def _agree_in_job(
    key: str, named: Named, text: str, failure: str | None, describe: Callable[[str], str]
) -> Agreement:
    from shardwise._torch.c10d import default_store

    store, rank, world = default_store(), dist.get_rank(), dist.get_world_size()
    mine = [f"{name}={_digest(t)}" for name, t, _ in named]
    told = None if failure is not None else hashlib.blake2b(text.encode()).hexdigest()
    if rank == 0 and told is not None:
        store.set(f"{key}/text", text)
    if failure is not None:
        store.compare_set(f"{key}/failed", "", json.dumps([rank, failure]))
    store.set(f"{key}/{rank}", json.dumps({"inputs": mine, "text": told}))
    entries: dict[int, dict[str, Any]] = {}

    def entry(r: int) -> dict[str, Any]:
        if r not in entries:
            entries[r] = json.loads(bytes(store.get(f"{key}/{r}")).decode())
        return entries[r]

    differs = _unlike_leader(named, mine, rank, entry)
    if differs is not None:
        if _first(store, f"{key}/first", rank):  # (the first differing rank says what it saw)
            store.set(f"{key}/what", json.dumps(differs))
        store.add(f"{key}/unlike", 1)
    leading = entry(0)["text"] if rank else told
    unlike_leading = told is not None and leading is not None and told != leading
    if unlike_leading and _first(store, f"{key}/other", rank):
        store.set(f"{key}/how", _described(describe, bytes(store.get(f"{key}/text")).decode()))
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])
    return Agreement(_unlike(store, key), _failed(store, key), _differs(store, key))


def _unlike_leader(
    named: Named, mine: list[str], rank: int, entry: Callable[[int], dict[str, Any]]
) -> tuple[str, int] | None:
    """(the first value of `named` unlike its leader's, the leader), or None."""
    for i, (name, _, leader) in enumerate(named):
        lead = leader(rank)
        if lead == rank:
            continue
        other = entry(lead)["inputs"]
        if len(other) != len(mine) or other[i] != mine[i]:
            return (name if len(other) == len(mine) else "the number of inputs", lead)
    return None


def _first(store: Any, key: str, rank: int) -> bool:
    """Whether this rank is the first to claim `key`."""
    return bytes(store.compare_set(key, "", str(rank))).decode() == str(rank)


def _described(describe: Callable[[str], str], leading: str) -> str:
    try:
        return describe(leading)
    except Exception:  # (no rank may stop before the others arrive: a plain answer)
        return "differs"


def _unlike(store: Any, key: str) -> Unlike:
    count = store.add(f"{key}/unlike", 0)
    if not count:
        return Unlike()
    name, lead = json.loads(bytes(store.get(f"{key}/what")).decode())
    return Unlike(count, (int(bytes(store.get(f"{key}/first"))),), name, (int(lead),))


def _failed(store: Any, key: str) -> tuple[int, str] | None:
    if not store.check([f"{key}/failed"]):
        return None
    rank, message = json.loads(bytes(store.get(f"{key}/failed")).decode())
    return int(rank), str(message)


def _differs(store: Any, key: str) -> tuple[int, str] | None:
    if not store.check([f"{key}/other"]):
        return None
    return int(bytes(store.get(f"{key}/other"))), bytes(store.get(f"{key}/how")).decode()


def _digest(t: torch.Tensor) -> str:
    """A digest of `t`'s dtype, shape and bytes (hex)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    plain = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    raw = plain.reshape(-1).view(torch.uint8)
    head = f"{t.dtype}{list(t.shape)}".encode()
    return hashlib.blake2b(head + bytes(raw.numpy()), digest_size=16).hexdigest()
