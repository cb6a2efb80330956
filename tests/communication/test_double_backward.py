"""Second-order gradients through the collective primitives: a gradient penalty (the gradient
taken with ``create_graph=True``, then differentiated again) equals the single-device math,
with the collectives each backward runs; PROD's gradient is differentiated once only and says
so."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tests.communication.test_collectives import _grid_math

import shardwise as sw
from shardwise.communication import get_rank
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

N = 4
Math = Callable[[list[torch.Tensor]], list[torch.Tensor]]
MakeOp = Callable[[], Callable[[torch.Tensor], torch.Tensor]]


def _stacked(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Math:
    return lambda xs: [reduce(torch.stack(xs))] * len(xs)


def _scattered(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Math:
    return lambda xs: list(reduce(torch.stack(xs)).chunk(len(xs), 0))


def _all_to_all(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([x.chunk(N, 0)[r] for x in xs], 1) for r in range(N)]


def _ring() -> Callable[[torch.Tensor], torch.Tensor]:
    rank = get_rank()
    op = sw.ops.NeighborExchange([(rank + 1) % N], [(rank - 1) % N], [[4, 3]], [[4, 3]])
    return lambda x: op((x,))[0]


def _grid() -> Callable[[torch.Tensor], torch.Tensor]:
    ids, _ = _grid_math(N, 1)
    sim = sw.testing.current_world()
    assert sim is not None
    per_rank = [sim.per_rank_int([ids[r][d] for r in range(N)]) for d in range(8)]
    return sw.ops.NeighborExchangeV2(per_rank, [1] * 4, per_rank, [1] * 4)


# name: (shape, the op (made inside the world), single-device math, backward collectives)
CASES: dict[str, tuple[tuple[int, ...], MakeOp, Math, dict[str, int]]] = {
    "AllReduce(sum)": ((4, 3), sw.ops.AllReduce, _stacked(lambda s: s.sum(0)), {"AllReduce": 3}),
    "AllReduce(max)": (
        (4, 3),
        lambda: sw.ops.AllReduce("max"),
        _stacked(lambda s: s.amax(0)),
        {"AllReduce": 3},
    ),
    "AllGather": (
        (2, 3),
        sw.ops.AllGather,
        lambda xs: [torch.cat(xs, 0)] * len(xs),
        {"ReduceScatter": 2, "AllGather": 1},
    ),
    "ReduceScatter(sum)": (
        (8, 3),
        sw.ops.ReduceScatter,
        _scattered(lambda s: s.sum(0)),
        {"AllGather": 2, "ReduceScatter": 1},
    ),
    # (max: each AllGather of the gradient comes with one of the output, for the mask)
    "ReduceScatter(max)": (
        (8, 3),
        lambda: sw.ops.ReduceScatter("max"),
        _scattered(lambda s: s.amax(0)),
        {"AllGather": 4, "ReduceScatter": 1},
    ),
    "Broadcast": (
        (4, 3),
        lambda: lambda x: sw.ops.Broadcast(1)((x,))[0],
        lambda xs: [xs[1]] * len(xs),
        {"Reduce": 2, "Broadcast": 1},
    ),
    "AlltoAll": ((8, 3), lambda: sw.ops.AlltoAll(N, 0, 1), _all_to_all, {"AlltoAll": 3}),
    "NeighborExchange": (
        (4, 3),
        _ring,
        lambda xs: [xs[(r - 1) % N] for r in range(N)],
        {"NeighborExchange": 3},
    ),
    "NeighborExchangeV2": ((1, 2, 3, 4), _grid, _grid_math(N, 1)[1], {"NeighborExchangeV2": 3}),
}


def _inputs(shape: tuple[int, ...]) -> tuple[list[torch.Tensor], list[float], list[float]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=g) for _ in range(N)]
    return xs, [r + 1.0 for r in range(N)], [2.0 * r + 1.0 for r in range(N)]


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_penalty_matches_single_device(name: str) -> None:
    """Each rank's loss is ``sum(y**2 * c_r)``; its gradient `g` (create_graph=True) enters a
    penalty ``sum(g**2 * d_r) + 0 * x.sum()``, whose gradient is one device's."""
    shape, make_op, math, backward = CASES[name]
    xs, c, d = _inputs(shape)
    leaves = [x.clone().requires_grad_() for x in xs]
    loss = sum((y**2 * c[r]).sum() for r, y in enumerate(math(leaves)))
    gs = torch.autograd.grad(loss, leaves, create_graph=True, materialize_grads=True)
    penalty = sum((g**2 * d[r]).sum() for r, g in enumerate(gs))
    want = torch.autograd.grad(penalty, leaves, materialize_grads=True)  # (Broadcast: zeros)
    with simulated_world(N) as world, CommRecorder() as rec:
        x = world.rank_map(lambda r: xs[r].clone()).requires_grad_()
        cw, dw = (world.rank_map(lambda r, v=v: torch.tensor(v[r])) for v in (c, d))
        y = make_op()(x)
        (g,) = torch.autograd.grad((y**2 * cw).sum(), x, create_graph=True)
        assert_matches_single_device(g, lambda r: gs[r].detach(), what="first-order gradient")
        ((g**2 * dw).sum() + 0 * x.sum()).backward()
        assert_matches_single_device(x.grad, lambda r: want[r], what="penalty gradient")
    kind = name.split("(")[0]
    assert rec.count(phase="forward") == rec.count(kind, "forward") == 1
    assert {k: rec.count(k, "backward") for k in backward} == backward
    assert rec.count(phase="backward") == sum(backward.values())
    assert {r.group for r in rec.records} == {tuple(range(N))}


@pytest.mark.parametrize("primitive", ["AllReduce", "ReduceScatter"])
def test_prod_gradient_is_differentiated_once_only(primitive: str) -> None:
    """PROD's gradient (the others' product) has no second derivative: differentiating it
    raises instead of dropping the penalty's part."""
    op = getattr(sw.ops, primitive)("prod")
    xs, _, _ = _inputs((4, 3))
    with simulated_world(N) as world:
        x = world.rank_map(lambda r: xs[r].clone()).requires_grad_()
        (g,) = torch.autograd.grad((op(x) ** 2).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            ((g**2).sum() + 0 * x.sum()).backward()
