"""`redistribute` on 8 simulated ranks of a (dp=2, sp=2, mp=2) matrix: every rank's block, the
exact collectives (kind, group, count, bytes, forward and backward) and the gradients, against
the single-device tensor and single-device autograd.

Gradient convention (see docs/redistribution.md): every step's backward is its exact adjoint,
so a replicated source gets *partial* gradients whose sum over its replicas is the gradient of
the logical tensor. We check (1) that sum against single-device autograd for arbitrary per-rank
upstream gradients, (2) per rank when the source is not replicated, and (3) exact adjointness,
<x, backward(w)> == <forward(x), w>, with a different random block on every rank.
"""

from __future__ import annotations

import random

import pytest
import torch

from shardwise.communication import create_group
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution import plan_redistribution, redistribute
from shardwise.redistribution._execute import group_name
from shardwise.testing import (
    CommRecorder,
    SimulatedWorld,
    assert_matches_single_device,
    simulated_world,
)

from ._layouts import lay
from .test_planner_exhaustive import LAYOUTS, MATRIX

SHAPE = (8, 8, 8)
BACKWARD = {"AllGather": "ReduceScatter", "AlltoAll": "AlltoAll"}

CHOSEN = [
    (lay("dp", "sp", "mp"), lay("mp", ("sp", "dp"), None)),
    (lay(None, None, None), lay("mp", ("sp", "dp"), None)),
    (lay("mp", ("sp", "dp"), None), lay(None, None, None)),
    (lay("mp", ("sp", "dp"), None), lay(("sp", "dp"), None, "mp")),
    (lay(("dp", "sp", "mp"), None, None), lay(("mp", "sp", "dp"), None, None)),
    (lay(("sp", "dp"), "mp", None), lay(None, ("dp", "sp"), "mp")),
    (lay("dp", "mp", None), lay("mp", "dp", None)),
    (lay("dp", None, None), lay(None, "dp", None)),
    (lay(None, "sp", None), lay("sp", None, "mp")),
    (lay("mp", None, None), lay("mp", None, None)),
]
rng = random.Random(4)
SAMPLED = [
    (TensorLayout(MATRIX, s), TensorLayout(MATRIX, d))
    for s, d in zip(rng.sample(LAYOUTS, 10), rng.sample(LAYOUTS, 10), strict=True)
]
CASES = CHOSEN + SAMPLED


def name(pair: tuple[TensorLayout, TensorLayout]) -> str:
    from shardwise.redistribution._plan import layout_map

    return f"{layout_map(pair[0])}->{layout_map(pair[1])}".replace(" ", "")


def scatter(
    parts: list[torch.Tensor], layout: TensorLayout, shape: tuple[int, ...]
) -> torch.Tensor:
    """Sum of every rank's block placed at its slice of a zero global tensor."""
    out = torch.zeros(shape, dtype=torch.float64)
    for r, part in enumerate(parts):
        out[layout.local_slice(r, shape)] += part.double()
    return out


def check_collectives(
    rec: CommRecorder, src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...]
) -> None:
    plan = plan_redistribution(src, dst, shape)
    forward = [(r.kind, r.group) for r in rec.select(phase="forward")]
    backward = [(r.kind, r.group) for r in rec.select(phase="backward")]
    assert forward == plan.collectives(0)
    assert backward == [(BACKWARD[k], g) for k, g in reversed(plan.collectives(0))]
    assert sum(r.bytes_sent for r in rec.select(phase="forward")) == plan.total_bytes
    assert rec.count("AllReduce") == 0


def run_case(
    world: SimulatedWorld, src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], seed: int
) -> None:
    with world.outside():  # single device: loss = sum over ranks of <w_r, X[dst block of r]>
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(shape, generator=g)
        upstream = [torch.randn(dst.local_shape(shape), generator=g) for _ in range(8)]
        leaf = full.clone().requires_grad_()
        total = sum((leaf[dst.local_slice(r, shape)] * w).sum() for r, w in enumerate(upstream))
        assert isinstance(total, torch.Tensor)
        total.backward()
        want = leaf.grad
        assert want is not None
    x = world.rank_map(lambda r: full[src.local_slice(r, shape)].clone()).requires_grad_()
    with CommRecorder() as rec:
        y = redistribute(x, src, dst, shape)
        (y * world.rank_map(lambda r: upstream[r])).sum().backward()
    assert_matches_single_device(y, lambda r: full[dst.local_slice(r, shape)], what="block")
    check_collectives(rec, src, dst, shape)
    assert x.grad is not None
    grads = world.local_tensors(x.grad)
    with world.outside():
        assert_matches_single_device(scatter(grads, src, shape), want, what="gradient sum")
    if not src.replicated_axes():
        assert_matches_single_device(x.grad, lambda r: want[src.local_slice(r, shape)])


@pytest.mark.parametrize(("src", "dst"), CASES, ids=[name(c) for c in CASES])
def test_blocks_collectives_and_gradients(src: TensorLayout, dst: TensorLayout) -> None:
    with simulated_world(8) as world:
        run_case(world, src, dst, SHAPE, seed=0)


def test_a_dim_gathered_over_several_axes_is_one_all_gather() -> None:
    """A dim split over a tuple of axes, gathered over all of them, runs one AllGather over
    their combined group (its blocks in the tuple's order, first axis outer, also when that is
    not rank order), its adjoint one ReduceScatter, as MindSpore gathers a tuple dim."""
    world8 = tuple(range(8))
    cases = [
        (lay(("dp", "sp", "mp"), None, None), lay(None, None, None), world8),
        (lay(("mp", "sp", "dp"), None, None), lay(None, None, None), world8),
        (lay(("dp", "mp", "sp"), None, None), lay("dp", None, None), (0, 1, 2, 3)),
        (lay("sp", ("mp", "dp"), None), lay("sp", None, None), (0, 1, 4, 5)),
    ]
    with simulated_world(8) as world:
        for i, (src, dst, group) in enumerate(cases):
            with CommRecorder() as rec:
                run_case(world, src, dst, SHAPE, seed=20 + i)
            assert [(r.kind, r.group) for r in rec.records] == [
                ("AllGather", group),
                ("ReduceScatter", group),
            ], (src, dst)


def test_exact_adjoint_with_different_replicas() -> None:
    """<x, grad> == <y, w> for random, unequal blocks on replicas: backward is the adjoint."""
    for src, dst in CHOSEN[:7]:
        g = torch.Generator().manual_seed(1)
        xs = [
            torch.randn(src.local_shape(SHAPE), generator=g, dtype=torch.float64) for _ in range(8)
        ]
        ws = [
            torch.randn(dst.local_shape(SHAPE), generator=g, dtype=torch.float64) for _ in range(8)
        ]
        with simulated_world(8) as world:
            x = world.from_local_tensors(xs).requires_grad_()
            y = redistribute(x, src, dst, SHAPE)
            (y * world.from_local_tensors(ws)).sum().backward()
            assert x.grad is not None
            ys, grads = world.local_tensors(y), world.local_tensors(x.grad)
            with world.outside():
                lhs = sum(float((a * b).sum()) for a, b in zip(xs, grads, strict=True))
                rhs = sum(float((a * b).sum()) for a, b in zip(ys, ws, strict=True))
                assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-9), (src, dst)


def test_uneven_shape_and_axis_of_size_one() -> None:
    m = DeviceMatrix((2, 1, 4), ("dp", "sp", "mp"))
    cases = [
        (lay("sp", "mp", None, matrix=m), lay("mp", None, ("dp", "sp"), matrix=m), (8, 4, 6)),
        (lay(("dp", "mp"), None, None, matrix=m), lay(None, "mp", "dp", matrix=m), (8, 4, 6)),
    ]
    with simulated_world(8) as world:
        for i, (src, dst, shape) in enumerate(cases):
            run_case(world, src, dst, shape, seed=i)


def test_groups_are_created_once_and_reused() -> None:
    from shardwise.communication import get_group_size

    with simulated_world(8) as world:
        for _ in range(2):
            run_case(world, *CHOSEN[0], SHAPE, seed=3)
        dp = group_name(MATRIX, 0, (0, 4))
        assert dp.startswith("redistribution:dp@") and dp.endswith(":0-4")
        assert get_group_size(dp) == 2
        assert get_group_size(group_name(MATRIX, 2, (0, 1))) == 2
        with pytest.raises(ValueError, match="exists"):
            create_group(dp, [0, 4])


def test_errors_before_any_collective() -> None:
    src, dst = lay("dp", None, None), lay(None, "dp", None)
    with simulated_world(8) as world, CommRecorder() as rec:
        bad = world.rank_map(lambda r: torch.zeros(8, 8, 8))
        with pytest.raises(ValueError, match=r"local block has shape \[8, 8, 8\].*\[4, 8, 8\]"):
            redistribute(bad, src, dst, SHAPE)
        x = world.rank_map(lambda r: torch.zeros(4, 8, 8))
        other = plan_redistribution(src, lay(None, None, None), SHAPE)
        with pytest.raises(ValueError, match="the plan is for"):
            redistribute(x, src, dst, SHAPE, plan=other)
        # (a real job runs this rank_list, tests/multiprocess; here its groups are not
        # translates of one another, which one process running every rank cannot do)
        shuffled = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"), (3, 0, 6, 5, 1, 7, 2, 4))
        ssrc, sdst = TensorLayout(shuffled, src.dims), TensorLayout(shuffled, dst.dims)
        with pytest.raises(ValueError, match=r"not rank 0's group .* shifted"):
            redistribute(x, ssrc, sdst, SHAPE)
        assert rec.records == []


def test_plan_for_another_itemsize_is_refused() -> None:
    """A plan's bytes are what a CommRecorder sums to: a plan made for float32 (the default
    itemsize 4) run on a float64 block is refused before any collective, naming both itemsizes
    and the plan to make; the plan for itemsize 8 runs and its bytes are the recorded ones."""
    src, dst = CHOSEN[0]
    full = torch.arange(512, dtype=torch.float64).reshape(SHAPE)
    with simulated_world(8) as world:
        x = world.rank_map(lambda r: full[src.local_slice(r, SHAPE)].clone())
        with (
            CommRecorder() as rec,
            pytest.raises(ValueError, match=r"itemsize=4.*itemsize 8.*itemsize=8"),
        ):
            redistribute(x, src, dst, SHAPE, plan=plan_redistribution(src, dst, SHAPE))
        assert rec.records == []
        plan = plan_redistribution(src, dst, SHAPE, itemsize=8)
        with CommRecorder() as rec:
            y = redistribute(x, src, dst, SHAPE, plan=plan)
        assert rec.total_bytes() == plan.total_bytes
        assert_matches_single_device(y, lambda r: full[dst.local_slice(r, SHAPE)])


def test_reversed_rank_list() -> None:
    """A rank_list whose groups are translates of one another (here reversed: blocks permuted
    around each collective) runs as in a real job (tests/multiprocess covers it too)."""
    backwards = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"), tuple(range(7, -1, -1)))
    with simulated_world(8) as world:
        for i, (src, dst) in enumerate(CHOSEN[:4] + CHOSEN[6:8]):
            rsrc, rdst = TensorLayout(backwards, src.dims), TensorLayout(backwards, dst.dims)
            run_case(world, rsrc, rdst, SHAPE, seed=10 + i)


def test_plan_is_reused() -> None:
    src, dst = CHOSEN[0]
    plan = plan_redistribution(src, dst, SHAPE)
    full = torch.arange(512.0).reshape(SHAPE)
    with simulated_world(8) as world:
        x = world.rank_map(lambda r: full[src.local_slice(r, SHAPE)].clone())
        y = redistribute(x, src, dst, SHAPE, plan=plan)
        assert_matches_single_device(y, lambda r: full[dst.local_slice(r, SHAPE)])
