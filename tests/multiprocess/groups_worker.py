"""Checks of `init` / `release` / `create_group` on real ranks (run last in the 2-process job
of two_ranks_worker.py):

- `uneven_groups_refused`: rank 0 makes a one-rank group the other rank does not make, then
  both make a pair: torch names a member-only group by its ranks and how many groups the
  process holds, so the two waited for each other for the whole timeout and failed naming a
  store key only. Both ranks now get a ValueError naming the group and the fix at once.
- `init_again_after_release`: `init()` after `release()` made the new world group read the
  addresses the first one left in the launcher's store ("Connection refused" in ``init()``,
  "Connection reset by peer" in the first collective, or a hang, about 3 jobs in 5). Each
  ``init()`` meets under its own prefix now.
"""

from __future__ import annotations

import re

import torch

import shardwise as sw
from shardwise.communication import create_group, destroy_group, get_rank, init, release


def checks() -> None:
    """Run in a 2-rank job that has called ``init()``; ends initialized (a second time)."""
    rank = get_rank()
    if rank == 0:
        create_group("solo", [0])
    try:
        create_group("pair", [0, 1])
    except ValueError as e:
        got = re.search(
            r"rank (\d) holds (\d+) process group\(s\) and rank (\d) holds (\d+)", str(e)
        )
        assert got is not None and "create_group('pair', [0, 1])" in str(e), e
        mine, other, theirs = int(got[2]), int(got[3]), int(got[4])
        assert int(got[1]) == rank and other == 1 - rank and mine - theirs == 1 - 2 * rank, e
        assert "same order and number on every member, one-rank groups included" in str(e), e
        print("CHECK uneven_groups_refused OK", flush=True)
    if rank == 0:
        destroy_group("solo")
    release()
    init()
    total = sw.ops.AllReduce()(torch.full((2,), float(rank + 1)))
    assert total.tolist() == [3.0, 3.0], total
    create_group("pair", [0, 1])
    assert sw.ops.AllReduce(group="pair")(torch.ones(1)).tolist() == [2.0]
    print("CHECK init_again_after_release OK", flush=True)
