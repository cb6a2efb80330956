"""Many primitives' device matrices on one global mesh: every rank keeps the same slice."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from shardwise.layout import (
    DeviceMatrix,
    TensorLayout,
    axis_runs,
    common_refinement,
    refine,
    strategy_layouts,
    to_placements,
)

MATMUL = [[0, 1], [1, 2]]
SEED_003 = [  # (strategy, rule, shapes) of every primitive of seed 003 on 8 devices
    (((2, 4), (4, 1)), MATMUL, [(32, 784), (784, 512)]),
    (((4, 1),), None, [(32, 512)]),
    (((1, 8), (8, 1)), MATMUL, [(32, 512), (512, 512)]),
    (((8, 1),), None, [(32, 512)]),
    (((8, 1), (1, 1)), MATMUL, [(32, 512), (512, 10)]),
]


def test_common_refinement() -> None:
    assert common_refinement([(2, 4, 1), (4, 1, 2), (1, 8, 1), (8, 1)]) == (2, 2, 2)
    assert common_refinement([(2, 6), (6, 2)]) == (2, 3, 2)
    assert common_refinement([(8,)]) == (8,)
    assert common_refinement([(1, 1)]) == (1,)
    with pytest.raises(ValueError, match=r"a block of 4 consecutive ranks does not tile .* of 6"):
        common_refinement([(3, 4), (2, 6)])  # (3 blocks of 4 ranks, 2 blocks of 6)
    with pytest.raises(ValueError, match="different numbers of devices"):
        common_refinement([(2, 2), (8,)])


def test_axis_runs() -> None:
    assert axis_runs((2, 4, 1), (2, 2, 2)) == [(0,), (1, 2), ()]
    assert axis_runs((4, 1, 2), (2, 2, 2)) == [(0, 1), (), (2,)]
    assert axis_runs((2, 1, 4), (2, 1, 4)) == [(0,), (), (2,)]
    with pytest.raises(ValueError, match=r"\(4, 2\) does not refine \(2, 4\)"):
        axis_runs((2, 4), (4, 2))


def test_seed_003_primitives_on_one_global_mesh_keep_every_slice() -> None:
    results = [strategy_layouts(s, 8, rule, shapes=shapes) for s, rule, shapes in SEED_003]
    shape = common_refinement([r.matrix.shape for r in results])
    fine = DeviceMatrix(shape, ("m0", "m1", "m2"))
    for res, (_, _, shapes) in zip(results, SEED_003, strict=True):
        for layout, tshape in zip(res.layouts, shapes, strict=True):
            moved = refine(layout, fine)
            for rank in range(8):
                assert moved.local_slice(rank, tshape) == layout.local_slice(rank, tshape)
    x = strategy_layouts(((4, 1),), 8).layouts[0]
    assert to_placements(refine(x, fine))[:2] == (Shard(0), Shard(0))


def test_refine_rejects_other_rank_orders() -> None:
    coarse = DeviceMatrix((2, 2), ("a", "b"), (3, 2, 1, 0))
    with pytest.raises(ValueError, match="order the ranks differently"):
        refine(TensorLayout(coarse, ((0,),)), DeviceMatrix((2, 2), ("x", "y")))


def test_refined_tensor_slices_match_numerically() -> None:
    coarse = DeviceMatrix((2, 6), ("a", "b"))
    fine = DeviceMatrix((2, 3, 2), ("x", "y", "z"))
    layout = TensorLayout(coarse, ((1, 0),))  # ("b", "a")
    moved = refine(layout, fine)
    assert moved.dims == ((1, 2, 0),)
    full = torch.arange(24)
    for rank in range(12):
        assert torch.equal(
            full[moved.local_slice(rank, (24,))], full[layout.local_slice(rank, (24,))]
        )
