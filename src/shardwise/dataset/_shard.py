"""Which shard this pipeline reads: explicit ``num_shards``/``shard_id``, or ``"auto"``.

- `ShardSetting.create`: validates the user's arguments.
- `ShardSetting.resolve`: ``(num_shards, shard_id)`` now; ``"auto"`` asks
  ``shardwise.communication`` (the world group) each time, so a pipeline built before
  ``init()`` shards once the job is up.
- `agree_seed`: for ``"auto"`` with several ranks, every rank takes rank 0's seed (one
  broadcast, the first time the pipeline is iterated), so an unseeded job still agrees on
  the global order.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal

import torch

from shardwise.dataset._args import as_int

AUTO: Literal["auto"] = "auto"
NumShards = int | Literal["auto"] | None


@dataclass(frozen=True)
class ShardSetting:
    """``num_shards`` (an int, ``"auto"`` or None) and ``shard_id`` as given by the user."""

    num_shards: NumShards = None
    shard_id: int | None = None

    @staticmethod
    def create(num_shards: object, shard_id: object, who: str) -> ShardSetting:
        """Validate the arguments of a source dataset.

        Raises:
            ValueError: inconsistent or out-of-range values; the message says what to pass.
        """
        if num_shards is None:
            if shard_id is not None:
                raise ValueError(f"{who}: shard_id={shard_id!r} needs num_shards as well")
            return ShardSetting()
        if isinstance(num_shards, str) and num_shards == AUTO:
            if shard_id is not None:
                raise ValueError(
                    f"{who}: num_shards='auto' takes the shard from the job's rank; "
                    "leave shard_id=None"
                )
            return ShardSetting(AUTO, None)
        count = as_int(num_shards)
        if count is None or count < 1:
            raise ValueError(
                f"{who}: num_shards={num_shards!r} must be an int >= 1, 'auto' or None"
            )
        if shard_id is not None and not isinstance(shard_id, numbers.Integral | str | float):
            _per_rank(shard_id, who)  # (``get_rank()`` in a simulated world: one value a rank)
        shard = as_int(shard_id)
        if shard is None or not 0 <= shard < count:
            raise ValueError(
                f"{who}: shard_id={shard_id!r} must be an int in [0, {count}) "
                f"when num_shards={count}"
            )
        return ShardSetting(count, shard)

    def resolve(self) -> tuple[int, int]:
        """``(num_shards, shard_id)``; ``"auto"`` gives ``(group size, rank)`` or ``(1, 0)``.

        Raises:
            ValueError: ``"auto"`` in a process that runs several ranks (``simulated_world()``).
        """
        if self.num_shards is None:
            return 1, 0
        if self.num_shards != AUTO:
            assert self.shard_id is not None
            return int(self.num_shards), self.shard_id
        from shardwise import communication as comm

        if not comm.is_initialized():
            return 1, 0
        if comm.holds_several_ranks():
            raise ValueError(
                f"num_shards='auto' reads the shard of the one rank a process runs, but this "
                f"process runs {len(comm.process_ranks())} ranks (simulated_world); pass "
                "num_shards and shard_id explicitly"
            )
        (rank,) = comm.process_ranks()
        return comm.get_group_size(), rank

    @property
    def is_auto(self) -> bool:
        """Whether the shard comes from the job (``num_shards="auto"``)."""
        return self.num_shards == AUTO


def agree_seed(seed: int) -> int:
    """Rank 0's `seed`, broadcast to every rank of the world group (a collective).

    Example:
        >>> agree_seed(torch.initial_seed())   # same value on every rank afterwards
    """
    from shardwise import communication as comm

    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    t = torch.tensor([seed & ((1 << 63) - 1)], dtype=torch.int64, device=device)
    (out,) = comm.Broadcast(0)(t)
    return int(out.item())


def _per_rank(shard_id: object, who: str) -> None:
    """Raise ValueError naming the fixes when `shard_id` is a simulated world's per-rank value
    (``get_rank()`` inside ``simulated_world()``); nothing otherwise."""
    from shardwise import communication as comm

    if comm.is_initialized() and comm.holds_several_ranks():
        n = len(comm.process_ranks())
        raise ValueError(
            f"{who}: shard_id={shard_id!r} holds one value per rank: this process runs {n} "
            f"ranks (simulated_world), and a dataset reads one shard; read the whole dataset "
            f"(num_shards=None) and pass world.rows(x) of each global batch (taken from the "
            f"iterator under `with world.outside():`), or build one "
            f"dataset per rank (shard_id=0 .. {n - 1})"
        )
