"""The process groups of one optimizer-parallel bucket, on this rank.

A parameter's data-parallel group is the ranks holding the same op-level block: those that
differ from this rank only along its replicated axes (`DeviceMatrix.group_along`, ordered by
coordinate, first axis outer). With a shard size ``s`` the group is cut into consecutive chunks
of ``s`` ranks: the *shard group* (this rank's chunk: AllGather of weights, ReduceScatter of
gradients) and the *copy group* (the ranks at the same position of every chunk: AllReduce of the
reduced shard when ``s`` is smaller than the group).

`bucket_groups` returns both (names created on first use, the same on every rank) and this
rank's position in the shard group (a per-rank symbolic int in a simulated world, where the
groups of rank 0 stand for their translates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise import communication as comm
from shardwise.layout import DeviceMatrix


@dataclass(frozen=True)
class BucketGroups:
    """This rank's groups for one bucket (None name: the world group; size 1: no collective).

    Attributes:
        shard: name of the shard group, and its size.
        copies: name of the copy group, and its size.
        position: this rank's index in the shard group (symbolic in a simulated world).
    """

    shard: str | None
    shard_size: int
    copies: str | None
    copies_size: int
    position: int


def _position(matrix: DeviceMatrix, axes: Sequence[int], rank: int) -> int:
    """This rank's index in its data-parallel group (works on symbolic ranks)."""
    pos = 0
    for a in axes:
        stride = math.prod(matrix.shape[a + 1 :])
        pos = pos * matrix.shape[a] + (rank // stride) % matrix.shape[a]
    return pos


def _named(kind: str, matrix: DeviceMatrix, ranks: Sequence[int]) -> str | None:
    ranks = tuple(sorted(ranks))
    if len(ranks) == comm.get_group_size():
        return None
    return comm.ensure_group(comm.scoped_group_name(f"hsdp-{kind}", str(matrix), ranks), ranks)


def group_ranks(
    matrix: DeviceMatrix, axes: Sequence[int], shard: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global rank `rank`'s (shard group, copy group) for data-parallel `axes` (pure).

    Example:
        >>> group_ranks(DeviceMatrix((4,), ("dp",)), (0,), 2, 3)
        ((2, 3), (1, 3))
    """
    members = matrix.group_along(rank, tuple(axes))
    pos = members.index(rank)
    chunk = pos // shard
    return tuple(members[chunk * shard : (chunk + 1) * shard]), tuple(members[pos % shard :: shard])


def bucket_groups(matrix: DeviceMatrix, axes: Sequence[int], shard: int) -> BucketGroups:
    """The shard and copy groups of this rank for data-parallel `axes` of `matrix`.

    Args:
        matrix: the plan's global device matrix (default rank_list in a simulated world).
        axes: the axes the parameters are replicated on.
        shard: the shard group size (1: no sharding, the copy group is the whole dp group).

    Returns:
        `BucketGroups`.
    """
    rank = comm.get_rank()
    simulated = not isinstance(rank, int)
    if simulated and matrix.rank_list != tuple(range(comm.get_group_size())):
        raise ValueError(f"in a simulated world {matrix} must use the default rank_list")
    shard_ranks, copy_ranks = group_ranks(matrix, axes, shard, 0 if simulated else rank)
    k = len(shard_ranks) * len(copy_ranks)
    real_pos = 0 if simulated else shard_ranks.index(rank)
    position = _position(matrix, axes, rank) % shard if simulated else real_pos
    return BucketGroups(
        _named("shard", matrix, shard_ranks) if shard > 1 else None,
        shard,
        _named("copies", matrix, copy_ranks) if k // shard > 1 else None,
        k // shard,
        position,
    )
