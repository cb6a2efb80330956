"""Layouts -> DTensor placements: the `_StridedShard` split-factor rule, checked exhaustively
against torch's own splitting code (the functions `distribute_tensor` calls, run locally: no
LocalTensorMode, which gets `_StridedShard` wrong) and by the real-process test in
tests/multiprocess/test_layout_placements_real.py."""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.layout import (
    DeviceMatrix,
    Layout,
    TensorLayout,
    device_mesh_for,
    from_placements,
    split_factor,
    to_placements,
)

LAYOUT = Layout((2, 2, 2), ("dp", "sp", "mp"))


def test_seed_003_placements() -> None:
    assert to_placements(LAYOUT("mp", ("sp", "dp"))) == (
        _StridedShard(1, split_factor=2), Shard(1), Shard(0)
    )  # fmt: skip
    assert to_placements(LAYOUT(("sp", "dp"), "None")) == (
        _StridedShard(0, split_factor=2), Shard(0), Replicate()
    )  # fmt: skip
    assert to_placements(LAYOUT(("dp", "sp"), "mp")) == (Shard(0), Shard(0), Shard(1))
    assert to_placements(LAYOUT("None", "None")) == (Replicate(),) * 3


def test_split_factor_three_axes() -> None:
    # ("mp", "dp", "sp") on (dp, sp, mp): dp sits under mp (not applied yet): 2; sp sits under mp
    # and dp, but dp is applied before sp: 2; mp is outermost: Shard.
    t = LAYOUT(("mp", "dp", "sp"))
    assert [split_factor(t, a) for a in range(3)] == [2, 2, 1]
    m = DeviceMatrix((2, 3, 4), ("a", "b", "c"))
    t = TensorLayout(m, ((2, 1, 0),))  # ("c", "b", "a"): reversed order
    assert [split_factor(t, a) for a in range(3)] == [12, 4, 1]
    assert to_placements(t) == (
        _StridedShard(0, split_factor=12), _StridedShard(0, split_factor=4), Shard(0)
    )  # fmt: skip


def test_size_one_axes_are_replicate() -> None:
    m = DeviceMatrix((1, 8, 1), ("d0", "d1", "d2"))
    assert to_placements(TensorLayout(m, ((0, 1), (2,)))) == (Replicate(), Shard(0), Replicate())


def simulate(
    full: torch.Tensor, matrix: DeviceMatrix, placements: tuple[Placement, ...], rank: int
) -> torch.Tensor:
    """What `distribute_tensor` leaves on `rank`: each placement's own `_split_tensor`, applied in
    mesh-dim order to the local piece, keeping this rank's chunk (what the scatter delivers)."""
    local = full
    coord = matrix.coord(rank)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard | _StridedShard):
            chunks, _ = p._split_tensor(local, matrix.shape[axis], with_padding=False)
            local = chunks[coord[axis]]
    return local


def all_layouts(matrix: DeviceMatrix, ndim: int) -> Iterator[TensorLayout]:
    """Every layout of an `ndim`-D tensor: each axis splits one dim or none, in every order."""
    axes = range(len(matrix.shape))
    for owner in itertools.product([None, *range(ndim)], repeat=len(matrix.shape)):
        groups = [[a for a in axes if owner[a] == d] for d in range(ndim)]
        for dims in itertools.product(*(itertools.permutations(g) for g in groups)):
            yield TensorLayout(matrix, tuple(dims))


MESHES = [(2, 2, 2), (4, 2), (2, 4), (3, 2, 2), (2, 3, 4), (2, 1, 4), (8,)]


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_rule_matches_torch_splitting_for_every_2d_layout(shape: tuple[int, ...]) -> None:
    matrix = DeviceMatrix(shape, tuple(f"a{i}" for i in range(len(shape))))
    n = math.prod(shape)
    full = torch.arange(n * n * 2).reshape(n, n * 2)
    count = 0
    for layout in all_layouts(matrix, 2):
        placements = to_placements(layout)
        for rank in matrix.rank_list:
            got = simulate(full, matrix, placements, rank)
            want = full[layout.local_slice(rank, full.shape)]
            assert torch.equal(got, want), (str(layout), placements, rank)
        count += 1
    assert count > 0


@pytest.mark.parametrize("shape", [(2, 3, 2, 2), (3, 1, 2, 2)], ids=str)
def test_rule_matches_torch_splitting_for_every_order_of_four_axes(shape: tuple[int, ...]) -> None:
    matrix = DeviceMatrix(shape, ("a", "b", "c", "d"))
    full = torch.arange(matrix.size * 3)
    for order in itertools.permutations(range(4)):
        layout = TensorLayout(matrix, (order,))
        placements = to_placements(layout)
        for rank in matrix.rank_list:
            got = simulate(full, matrix, placements, rank)
            assert torch.equal(got, full[layout.local_slice(rank, full.shape)]), (order, rank)


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 3, 4), (1, 8, 1)], ids=str)
def test_from_placements_inverts_to_placements(shape: tuple[int, ...]) -> None:
    matrix = DeviceMatrix(shape, ("a", "b", "c"))
    for layout in all_layouts(matrix, 2):
        back = from_placements(matrix, to_placements(layout), 2)
        assert back.dims == tuple(tuple(a for a in d if shape[a] > 1) for d in layout.dims)


def test_from_placements_reads_negative_dims_from_the_end() -> None:
    """DTensor accepts ``Shard(-1)``: it is the same layout as ``Shard(ndim - 1)`` (also for a
    _StridedShard); a dim outside the tensor is named in a ValueError, not wrapped around."""
    m = DeviceMatrix((2, 2), ("dp", "mp"))
    assert from_placements(m, (Shard(-1), Replicate()), 2) == from_placements(
        m, (Shard(1), Replicate()), 2
    )
    assert from_placements(m, (Shard(-1), Replicate()), 2).dims == ((), (0,))
    strided = (_StridedShard(-2, split_factor=2), Shard(0))
    assert from_placements(m, strided, 2).dims == ((1, 0), ())
    with pytest.raises(ValueError, match=r"mesh dim 0: .*tensor dim 2.* has 2 dims"):
        from_placements(m, (Shard(2), Replicate()), 2)
    with pytest.raises(ValueError, match=r"mesh dim 1: .*tensor dim -3"):
        from_placements(m, (Replicate(), Shard(-3)), 2)


def test_from_placements_errors() -> None:
    m = DeviceMatrix((2, 2), ("a", "b"))
    with pytest.raises(ValueError, match="has no layout"):
        from_placements(m, (Partial(), Replicate()), 1)
    with pytest.raises(ValueError, match="match no axis order"):
        from_placements(m, (_StridedShard(0, split_factor=3), Shard(0)), 1)
    with pytest.raises(ValueError, match="1 placements for"):
        from_placements(m, (Replicate(),), 1)


def test_device_mesh_for_one_rank_world_sets_names_ranks_and_timeout() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    matrix = DeviceMatrix((1, 1), ("dp", "mp"))
    mesh = device_mesh_for(matrix, timeout=datetime.timedelta(seconds=7))
    assert mesh.mesh_dim_names == ("dp", "mp")
    assert mesh.mesh.tolist() == [[0]]
    group = mesh.get_group("mp")
    assert group._get_backend(torch.device("cpu")).options._timeout.total_seconds() == 7
