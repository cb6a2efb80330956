"""A dry run: this process plays one rank of a world of N ranks, with no other process.

`dry_run(world_size, rank)` creates torch's ``"fake"`` process group (every collective returns
at once and moves nothing) with this process as `rank`, so that `get_group_size()` is N and
`get_rank()` is `rank` while a training script plans its job; `init()` finds the group made
and returns. ``shardwise plan`` uses it (`launch.dry_run`): plans are made from global shapes
and never read a collective's result, so they come out as in a real job of N ranks.

The ``"fake"`` backend is registered by a private torch module (`_torch.c10d.fake_process_group`,
checked by tests/test_torch_private_apis.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist

from shardwise._torch.c10d import fake_process_group
from shardwise.communication import _init


@contextlib.contextmanager
def dry_run(world_size: int, rank: int = 0) -> Iterator[None]:
    """Play `rank` of a `world_size`-rank job in this process, with no process group behind.

    Args:
        world_size: the job's size (>= 1).
        rank: the rank this process plays (0 <= rank < world_size).

    Raises:
        ValueError: a size below 1 or a rank outside the world.
        RuntimeError: a process group already exists in this process.

    Example:
        >>> with dry_run(1024, rank=5):
        ...     get_group_size(), get_rank()
        (1024, 5)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"dry_run: world_size={world_size!r} must be an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"dry_run: rank={rank!r} is outside the world of {world_size} ranks; "
            f"use a rank from 0 to {world_size - 1}"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "dry_run: a process group already exists in this process; "
            "call shardwise.communication.release() first"
        )
    store = fake_process_group().FakeStore()
    hook = sys.excepthook  # (torch wraps it to prefix "[rank<r>]: " at each init: put it back)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=store)
    try:
        yield
    finally:
        _init.forget_groups()
        dist.destroy_process_group()
        sys.excepthook = hook
