"""The process groups of one optimizer-parallel bucket, on this rank.

A parameter's data-parallel group is the ranks holding the same op-level block: those that
differ from this rank only along its replicated axes (`DeviceMatrix.group_along`, ordered by
coordinate, first axis outer). With a shard size ``s`` the group is cut into consecutive chunks
of ``s`` ranks: the *shard group* (this rank's chunk: AllGather of weights, ReduceScatter of
gradients) and the *copy group* (the ranks at the same position of every chunk: AllReduce of the
reduced shard when ``s`` is smaller than the group).

`bucket_groups` returns both (names created on first use, the same on every rank; found with
`communication.own_group`) and this rank's position in the shard group
(`communication.rank_value`).
"""

from __future__ import annotations

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
        position: this rank's index in the shard group (a rank-dependent int).
    """

    shard: str | None
    shard_size: int
    copies: str | None
    copies_size: int
    position: int


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
        matrix: the plan's global device matrix.
        axes: the axes the parameters are replicated on.
        shard: the shard group size (1: no sharding, the copy group is the whole dp group).

    Returns:
        `BucketGroups`.
    """
    shard_ranks = comm.own_group(lambda r: group_ranks(matrix, axes, shard, r)[0])
    copy_ranks = comm.own_group(lambda r: group_ranks(matrix, axes, shard, r)[1])
    k = len(shard_ranks) * len(copy_ranks)
    position = comm.rank_value(lambda r: group_ranks(matrix, axes, shard, r)[0].index(r))
    return BucketGroups(
        _named("shard", matrix, shard_ranks) if shard > 1 else None,
        shard,
        _named("copies", matrix, copy_ranks) if k // shard > 1 else None,
        k // shard,
        position,
    )
