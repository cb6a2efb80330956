"""Checks that the ranks of a job agree, made once per plan through the job's store (no
collective, no device memory), with the same answer on every rank:

- `ranks_unlike_leader`: the ranks whose value of a tensor differs from their leader rank's
  (inputs every rank passes alike).
- `agree_with_ranks`: that check together with two more in the same store round: whether each
  rank's description of a decision (a plan, as text) is rank 0's, and whether some rank failed
  to make it (its message), so that ranks which diverged stop together with a message instead
  of waiting for each other in a collective.

In a simulated world one process runs every rank: the values are compared directly, and the
decision is the same on every rank (one program makes it once).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise.communication import _sim

_checks = itertools.count()  # (each rank makes the same checks in the same order: their keys)

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
    being its `describe` of the difference (None: every rank's is rank 0's, or some failed)."""

    unlike: Unlike = Unlike()
    failed: tuple[int, str] | None = None
    differs: tuple[int, str] | None = None


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
        when a value is a meta tensor).

    Raises:
        RuntimeError: (a job) some rank did not reach the check within the store's timeout.
    """
    key = f"shardwise/same/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_checks)}"
    if not dist.is_initialized() or any(t.is_meta for _, t, _ in named):
        return Agreement()
    sim = _sim.current()
    if sim is not None:
        return Agreement(_unlike_in_world(sim, named))
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:  # (a dry run: no values)
        return Agreement()
    try:
        return _agree_in_job(key, named, text, failure, describe)
    except dist.DistStoreError as e:
        raise RuntimeError(
            f"comparing the ranks' {', '.join(n for n, _, _ in named) or 'plans'}: some rank did "
            f"not reach the check within the store's timeout (it stopped, called with other "
            f"inputs, or never made this call: every rank makes a wrapper's first call, or its "
            f"plan(), at the same point); see the other ranks' logs"
        ) from e


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
