"""Redistributions to, from and between strided layouts (`TensorLayout.groups`, ``sw.strided``)
on 8 simulated ranks of a (dp=2, sp=2, mp=2) matrix: every rank's block equals
``global[dst.local_index(rank, shape)]``, the collectives are the plan's (forward and their
adjoints backward), and the gradients summed over the replicas equal single-device autograd.
Also the plans themselves: a strided dim moves inside its groups (each step carries the group
count), and two different group counts on one dim go through the whole dim.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.layout import TensorLayout
from shardwise.redistribution import AllGather, AlltoAll, Slice, plan_redistribution, redistribute
from shardwise.redistribution._plan import layout_map
from shardwise.testing import (
    CommRecorder,
    SimulatedWorld,
    assert_matches_single_device,
    simulated_world,
)

from ._layouts import lay

SHAPE = (12, 8, 4)
BACKWARD = {"AllGather": "ReduceScatter", "AlltoAll": "AlltoAll"}


def strided(layout: TensorLayout, **groups: int) -> TensorLayout:
    """`layout` with dim ``d<k>`` cut in the given groups: ``strided(x, d0=3)``."""
    counts = [groups.get(f"d{d}", 1) for d in range(layout.ndim)]
    return TensorLayout(layout.matrix, layout.dims, tuple(counts))


CASES = [
    (lay(None, None, None), strided(lay("mp", None, None), d0=3)),
    (lay(None, None, None), strided(lay(("sp", "mp"), "dp", None), d0=3, d1=2)),
    (strided(lay("mp", None, None), d0=3), lay(None, None, None)),
    (strided(lay("mp", "dp", None), d0=3), lay("dp", "mp", None)),
    (lay("dp", "mp", None), strided(lay("mp", "dp", None), d0=3)),
    (strided(lay("mp", None, None), d0=3), strided(lay(None, "mp", None), d1=2)),
    (strided(lay("mp", None, None), d0=3), strided(lay("mp", None, None), d0=2)),
    (strided(lay(("dp", "mp"), None, None), d0=3), lay("mp", "dp", None)),
    (strided(lay("mp", "sp", "dp"), d0=3), strided(lay(("mp", "sp"), None, "dp"), d0=3)),
]


def name(pair: tuple[TensorLayout, TensorLayout]) -> str:
    return f"{layout_map(pair[0])}->{layout_map(pair[1])}".replace(" ", "")


def scatter(parts: list[torch.Tensor], layout: TensorLayout) -> torch.Tensor:
    """Sum of every rank's block placed at its index of a zero global tensor."""
    out = torch.zeros(SHAPE, dtype=torch.float64)
    for r, part in enumerate(parts):
        out[layout.local_index(r, SHAPE)] += part.double()
    return out


def run_case(world: SimulatedWorld, src: TensorLayout, dst: TensorLayout, seed: int) -> None:
    with world.outside():
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(SHAPE, generator=g)
        upstream = [torch.randn(dst.local_shape(SHAPE), generator=g) for _ in range(8)]
        leaf = full.clone().requires_grad_()
        total = sum((leaf[dst.local_index(r, SHAPE)] * w).sum() for r, w in enumerate(upstream))
        assert isinstance(total, torch.Tensor)
        total.backward()
        want = leaf.grad
        assert want is not None
    x = world.rank_map(lambda r: full[src.local_index(r, SHAPE)].clone()).requires_grad_()
    with CommRecorder() as rec:
        y = redistribute(x, src, dst, SHAPE)
        (y * world.rank_map(lambda r: upstream[r])).sum().backward()
    assert_matches_single_device(y, lambda r: full[dst.local_index(r, SHAPE)], what="block")
    plan = plan_redistribution(src, dst, SHAPE)
    forward = [(r.kind, r.group) for r in rec.select(phase="forward")]
    backward = [(r.kind, r.group) for r in rec.select(phase="backward")]
    assert forward == plan.collectives(0)
    assert backward == [(BACKWARD[k], g) for k, g in reversed(plan.collectives(0))]
    assert sum(r.bytes_sent for r in rec.select(phase="forward")) == plan.total_bytes
    assert x.grad is not None
    grads = world.local_tensors(x.grad)
    with world.outside():
        assert_matches_single_device(scatter(grads, src), want, what="gradient sum")


@pytest.mark.parametrize(("src", "dst"), CASES, ids=[name(c) for c in CASES])
def test_strided_blocks_collectives_and_gradients(src: TensorLayout, dst: TensorLayout) -> None:
    with simulated_world(8) as world:
        run_case(world, src, dst, seed=0)


def test_plans_carry_the_group_counts() -> None:
    whole, qkv = lay(None, None, None), strided(lay("mp", None, None), d0=3)
    cut = plan_redistribution(whole, qkv, SHAPE)
    assert cut.steps == (Slice(0, 2, 3),) and cut.total_bytes == 0
    assert "in each of 3 groups" in str(cut) and "strided(mp, 3)" in str(cut)
    gather = plan_redistribution(qkv, whole, SHAPE)
    assert gather.steps == (AllGather(0, 2, 3),)
    move = plan_redistribution(qkv, lay(None, "mp", None), SHAPE)
    assert move.steps == (AlltoAll(2, 0, 1, 3, 1),)
    # 3 groups -> 2 groups on dim 0: gathered whole, then cut again (a slice: no bytes)
    regroup = plan_redistribution(qkv, strided(lay("mp", None, None), d0=2), SHAPE)
    assert regroup.steps == (AllGather(0, 2, 3), Slice(0, 2, 2))
    assert regroup.layouts[-1] == strided(lay("mp", None, None), d0=2)


def test_local_index_and_ranges() -> None:
    qkv = strided(lay("mp", None, None), d0=3)
    assert qkv.local_ranges(1, SHAPE)[0] == (range(2, 4), range(6, 8), range(10, 12))
    full = torch.arange(12 * 8 * 4).reshape(SHAPE)
    block = full[qkv.local_index(1, SHAPE)]
    assert block.shape == (6, 8, 4) and block[:, 0, 0].tolist() == [64, 96, 192, 224, 320, 352]
    two = strided(lay("mp", "dp", None), d0=3, d1=2)  # two strided dims: an outer product
    assert full[two.local_index(5, SHAPE)].shape == two.local_shape(SHAPE)
    with pytest.raises(ValueError, match="strided: a rank's block is not one slice"):
        qkv.local_slice(0, SHAPE)
    with pytest.raises(ValueError, match=r"cannot be cut into 5 strided groups"):
        strided(lay("mp", None, None), d0=5).check(SHAPE, "w")
