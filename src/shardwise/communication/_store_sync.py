"""Waits and agreements between the ranks of a job through its rendezvous store (no
collective: these run where a collective cannot, at the exit or before a group exists).

- `comm_timeout`: how long any wait of shardwise's communication lasts
  (``SHARDWISE_COMM_TIMEOUT``, default 300 s; a ValueError naming the variable when it is
  not a number of seconds more than 0).
- `store_barrier`: every rank reaches a key (`_init.release` and the exit's barrier).
- `agree_on_group`: the members of a group about to be created check that torch gives it the
  same name on each of them (a group of `create_group`, see there).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Sequence
from typing import Any

from shardwise._envvars import comm_timeout_s
from shardwise._torch.c10d import live_group_count, member_group_name


def comm_timeout() -> datetime.timedelta:
    """``$SHARDWISE_COMM_TIMEOUT`` seconds (`_envvars.comm_timeout_s`).

    Raises:
        ValueError: the variable is set to something else than a number of seconds more than
            0 (names it, `env_seconds`).
    """
    return datetime.timedelta(seconds=comm_timeout_s())


def agree_on_group(store: Any, key: str, name: str, ranks: Sequence[int], rank: int) -> None:
    """Before the member-only group `name` of the sorted `ranks` is created, check through
    `store` (under `key`, the same on every member for this creation) that torch gives it the
    same name on every member.

    torch names such a group by its ranks and by how many process groups the process holds,
    and its members meet in the store under that name: a member that has created another group
    more or less than the others (a one-rank group on one rank only, say) would wait there for
    the whole timeout, and fail naming only a store key.

    Raises:
        ValueError: the members hold different numbers of process groups (names them).
        RuntimeError: a member did not reach this `create_group` within `comm_timeout()`.
    """
    held, mine = live_group_count(), member_group_name(list(ranks))
    store.set(f"{key}/{rank}", f"{mine}:{held}")
    for other in ranks:
        if other == rank:
            continue
        try:
            wait_key(store, f"{key}/{other}", comm_timeout())
        except RuntimeError as e:
            raise RuntimeError(
                f"create_group({name!r}, {list(ranks)}): rank {other} did not call "
                f"create_group({name!r}) within {comm_timeout().total_seconds():g} s "
                "(SHARDWISE_COMM_TIMEOUT): every member calls create_group with the same name "
                f"and rank_ids; see rank {other}'s log"
            ) from e
        theirs, _, count = bytes(store.get(f"{key}/{other}")).decode().rpartition(":")
        if theirs != mine:
            raise ValueError(
                f"create_group({name!r}, {list(ranks)}): rank {rank} holds {held} process "
                f"group(s) and rank {other} holds {count} (the world group, the groups of "
                "create_group and of device meshes not destroyed yet); torch names a group by "
                "its ranks and that count, so the members would wait for each other for the "
                "whole timeout: create groups in the same order and number on every member, "
                "one-rank groups included (create those on every rank, or after the groups "
                "they share)"
            )


def store_barrier(
    store: Any, key: str, rank: int, world: int, timeout: datetime.timedelta | None = None
) -> None:
    """Wait on `store` (add / set / check) until all `world` ranks have called this with `key`
    (each wait at most `timeout`, default `comm_timeout()`; a RuntimeError when it ends, naming
    the ranks that had not arrived).

    The store lives in rank 0's process (torch's default), so rank 0 returns last: only after
    every rank is past its wait, else a rank still waiting would lose its connection
    ("Connection reset by peer") when rank 0 exits.
    """
    timeout = comm_timeout() if timeout is None else timeout
    store.set(f"{key}/rank{rank}", "1")  # (who arrived: named when the wait times out)
    if store.add(key, 1) == world:
        store.set(f"{key}/done", "1")
    try:
        wait_key(store, f"{key}/done", timeout)
    except RuntimeError as e:
        late = [r for r in range(world) if not _arrived(store, f"{key}/rank{r}")]
        if not late:
            raise
        who = ", ".join(map(str, late))
        raise RuntimeError(
            f"release(): rank {who} did not reach release() within "
            f"{timeout.total_seconds():g} s (SHARDWISE_COMM_TIMEOUT); every rank waits there "
            "for all the others. A rank still working (an evaluation or a save on one rank) "
            "needs a longer SHARDWISE_COMM_TIMEOUT, or leave release() out: it is optional, "
            "the job's process group is released at exit"
        ) from e
    finally:  # (a rank that gave up has left too: rank 0 does not wait for it a second time)
        with contextlib.suppress(RuntimeError):
            if store.add(f"{key}/left", 1) == world:
                store.set(f"{key}/gone", "1")
    if rank == 0:
        wait_key(store, f"{key}/gone", timeout)


def _arrived(store: Any, key: str) -> bool:
    """Whether `key` is set on `store` (False when the store is gone)."""
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return True  # (no store to ask: nobody is named)


def wait_key(store: Any, key: str, timeout: datetime.timedelta) -> None:
    """Wait until `key` is set on `store`, at most `timeout`, by asking (``check``) rather than
    with torch's blocking ``wait``, whose timeout writes a c10d warning into the worker log of
    a job that may well succeed.

    Raises:
        RuntimeError: the time is up (or the store is gone), naming the key.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"store barrier: {key} not set within {timeout.total_seconds():g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
