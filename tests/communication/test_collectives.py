"""Each collective primitive vs single-process math: values and gradients on 2, 4, 8 simulated
ranks, on the world group and on sub-groups, plus the collectives each call records."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise.communication import create_group
from shardwise.testing import (
    CommRecorder,
    assert_matches_single_device,
    current_world,
    simulated_world,
    tiles,
)

Math = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def group_layouts(n: int) -> list[tuple[str, list[int]]]:
    """The world, its first half (a block) and, from 4 ranks, the even ranks (strided)."""
    out = [("world", list(range(n))), ("block", list(range(n // 2)))]
    if n >= 4:
        out.append(("strided", list(range(0, n, 2))))
    return out


CASES = [(n, kind, ranks) for n in (2, 4, 8) for kind, ranks in group_layouts(n)]
IDS = [f"n{n}-{kind}" for n, kind, _ in CASES]


def inputs(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def single_device(xs: list[torch.Tensor], ranks: list[int], math: Math) -> list[torch.Tensor]:
    """Per-rank outputs computed in one process: `math` applied on every tile of the group."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for tile in tiles(ranks, len(xs)) or []:
        for r, y in zip(tile, math([xs[r] for r in tile]), strict=True):
            out[r] = y
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def run_parity(
    n: int,
    ranks: list[int],
    shape: tuple[int, ...],
    make_op: Callable[[str | None], torch.nn.Module],
    math: Math,
    unpack: bool = False,
) -> CommRecorder:
    """Forward values and input gradients of `make_op(group)` equal the single-device math."""
    xs = inputs(n, shape)
    leaves = [x.clone().requires_grad_() for x in xs]
    want = single_device(leaves, ranks, math)
    weights = inputs(n, tuple(want[0].shape), seed=1)
    sum(((y * w).sum() for y, w in zip(want, weights, strict=True)), torch.tensor(0.0)).backward()
    with simulated_world(n) as world, CommRecorder() as rec:
        group = None if len(ranks) == n else create_group("g", ranks)
        x = world.rank_map(lambda r: xs[r].clone()).requires_grad_()
        y = make_op(group.name if group else None)(x)
        y = y[0] if unpack else y
        assert_matches_single_device(y, lambda r: want[r].detach(), what="forward")
        (y * world.rank_map(lambda r: weights[r])).sum().backward()
        grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]
        assert_matches_single_device(x.grad, lambda r: grads[r], what="gradient")
    return rec


@pytest.mark.parametrize(("n", "kind", "ranks"), CASES, ids=IDS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_all_reduce(n: int, kind: str, ranks: list[int], op: str) -> None:
    def math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        s = torch.stack(xs)
        red = {"sum": s.sum(0), "max": s.amax(0), "min": s.amin(0), "prod": s.prod(0)}[op]
        return [red] * len(xs)

    rec = run_parity(n, ranks, (4, 3), lambda g: sw.ops.AllReduce(op, group=g), math)
    assert rec.count("AllReduce", "forward") == 1
    # (prod: the gradient's sum, the zero count and the nonzero product of the others' factors)
    assert rec.count("AllReduce", "backward") == (3 if op == "prod" else 1)
    assert rec.records[0].group == tuple(ranks)


@pytest.mark.parametrize("zeros", [[0], [0, 2]], ids=["one zero", "two zeros"])
@pytest.mark.parametrize("primitive", ["AllReduce", "ReduceScatter"])
def test_prod_gradient_where_a_factor_is_zero(zeros: list[int], primitive: str) -> None:
    """The gradient of a product by one factor is the product of the others: also where a
    factor is 0 (it was ``out / x``: NaN there, and 0 where another rank's factor was 0)."""
    xs = [x.abs() + 0.5 for x in inputs(4, (4, 3))]
    for r in zeros:
        xs[r][1, 2] = xs[r][3, 0] = 0.0
    leaves = [x.clone().requires_grad_() for x in xs]
    prod = torch.stack(leaves).prod(0)
    want = [prod] * 4 if primitive == "AllReduce" else list(prod.chunk(4, 0))
    sum(((y * (r + 1)).sum() for r, y in enumerate(want)), torch.tensor(0.0)).backward()
    with simulated_world(4) as world:
        x = world.rank_map(lambda r: xs[r].clone()).requires_grad_()
        op = getattr(sw.ops, primitive)("prod")
        (op(x) * world.rank_map(lambda r: torch.tensor(r + 1.0))).sum().backward()
        assert_matches_single_device(x.grad, lambda r: leaves[r].grad, what="gradient")


@pytest.mark.parametrize(("n", "kind", "ranks"), CASES, ids=IDS)
def test_all_gather(n: int, kind: str, ranks: list[int]) -> None:
    rec = run_parity(
        n, ranks, (2, 3), lambda g: sw.ops.AllGather(g), lambda xs: [torch.cat(xs)] * len(xs)
    )
    assert [(r.kind, r.phase) for r in rec.records] == [
        ("AllGather", "forward"),
        ("ReduceScatter", "backward"),
    ]


@pytest.mark.parametrize(("n", "kind", "ranks"), CASES, ids=IDS)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(n: int, kind: str, ranks: list[int], op: str) -> None:
    k = len(ranks)

    def math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        s = torch.stack(xs)
        red = s.sum(0) if op == "sum" else s.amax(0)
        return list(red.chunk(k, 0))

    rec = run_parity(n, ranks, (2 * k, 3), lambda g: sw.ops.ReduceScatter(op, g), math)
    assert rec.count("ReduceScatter", "forward") == 1
    assert rec.count("AllGather", "backward") >= 1


@pytest.mark.parametrize(("n", "kind", "ranks"), CASES, ids=IDS)
def test_broadcast(n: int, kind: str, ranks: list[int]) -> None:
    root = ranks[-1]
    idx = ranks.index(root)
    rec = run_parity(
        n,
        ranks,
        (3, 2),
        lambda g: sw.ops.Broadcast(root, g),
        lambda xs: [xs[idx]] * len(xs),
        unpack=True,
    )
    assert [(r.kind, r.phase) for r in rec.records] == [
        ("Broadcast", "forward"),
        ("Reduce", "backward"),
    ]


LATER_COPIES = [(4, [2, 3]), (4, [1, 3]), (8, [4, 5, 6, 7]), (8, [1, 3, 5, 7])]


@pytest.mark.parametrize(("n", "ranks"), LATER_COPIES, ids=[f"{r}of{n}" for n, r in LATER_COPIES])
def test_a_group_named_by_a_later_copy(n: int, ranks: list[int]) -> None:
    """A group named by a translate other than the first ([2, 3] of 4 runs with [0, 1]):
    each copy computes what a real job's group of those ranks does (collectives left every
    rank's value as it was, or returned garbage, where the group did not hold rank 0)."""
    root = ranks[0]

    def add(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.stack(xs).sum(0)] * len(xs)

    def scatter(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.stack(xs).sum(0).chunk(len(xs), 0))

    run_parity(n, ranks, (4, 3), lambda g: sw.ops.AllReduce(group=g), add)
    run_parity(
        n, ranks, (2, 3), lambda g: sw.ops.AllGather(g), lambda xs: [torch.cat(xs)] * len(xs)
    )
    run_parity(
        n, ranks, (3, 2), lambda g: sw.ops.Broadcast(root, g), lambda xs: [xs[0]] * len(xs), True
    )
    run_parity(n, ranks, (len(ranks), 3), lambda g: sw.ops.ReduceScatter("sum", g), scatter)
    with simulated_world(n) as world:
        create_group("g", ranks)
        index = {r: i for tile in tiles(ranks, n) or [] for i, r in enumerate(tile)}
        assert world.values(sw.communication.get_rank("g")) == [index[r] for r in range(n)]
        assert index[ranks[1]] == 1


def test_neighbor_exchange_in_a_strided_group() -> None:
    """Each rank sends to its partner in its own copy of the group [0, 2] (rank 1 to 3, as the
    copy [1, 3] does in a job): it was refused as 'not a rank of group pair[0, 2]'."""
    xs = inputs(4, (2,))
    with simulated_world(4) as world:
        create_group("pair", sw.communication.own_group(lambda r: [r % 2, r % 2 + 2]))
        partner = (sw.communication.get_rank() + 2) % 4
        op = sw.ops.NeighborExchange([partner], [partner], [[2]], [[2]], group="pair")
        x = world.rank_map(lambda r: xs[r].clone()).requires_grad_()
        (y,) = op((x,))
        assert_matches_single_device(y, lambda r: xs[(r + 2) % 4])
        (y * world.rank_map(lambda r: torch.full((2,), r + 1.0))).sum().backward()
        assert_matches_single_device(x.grad, lambda r: torch.full((2,), (r + 2) % 4 + 1.0))


def test_broadcast_returns_tuple_of_all_inputs() -> None:
    with simulated_world(2) as world:
        a = world.rank_map(lambda r: torch.full((2,), float(r)))
        b = world.rank_map(lambda r: torch.full((3,), 10.0 + r))
        out = sw.ops.Broadcast(1)((a, b))
        assert isinstance(out, tuple) and len(out) == 2
        assert_matches_single_device(out, [torch.full((2,), 1.0), torch.full((3,), 11.0)])


def test_a_tensor_every_rank_holds_alike_takes_part_from_every_rank() -> None:
    """In a simulated world a tensor made from Python data (``torch.tensor([...])`` in the step,
    or before the world) is one plain tensor every rank holds; a collective takes it from every
    rank, as in a real job: the sums were the value itself (one rank's), the scatters and
    exchanges every rank's own copy unchanged."""
    from shardwise.communication import _collectives as C

    x = [0.0, 1.0, 2.0, 3.0]
    with simulated_world(4):
        t = torch.tensor(x)  # (plain: made from data)
        assert_matches_single_device(sw.ops.AllReduce()(t), torch.tensor(x) * 4)
        assert_matches_single_device(sw.ops.AllReduce()(torch.tensor(1.0)), torch.tensor(4.0))
        assert_matches_single_device(
            sw.ops.ReduceScatter()(t), lambda r: torch.tensor([4.0 * x[r]])
        )
        assert_matches_single_device(sw.ops.AlltoAll(4, 0, 0)(t), lambda r: torch.full((4,), x[r]))
        assert_matches_single_device(sw.ops.AllGather()(t), torch.tensor(x * 4))
        total = torch.tensor(2.0)
        C.all_reduce_(total, C.ReduceOp.SUM, None)  # (in place: the plain tensor gets the sum)
        assert float(total) == 8.0


@pytest.mark.parametrize(("n", "kind", "ranks"), CASES, ids=IDS)
@pytest.mark.parametrize(("split_dim", "concat_dim"), [(0, 1), (1, 0), (0, 0), (2, 1)])
def test_all_to_all(n: int, kind: str, ranks: list[int], split_dim: int, concat_dim: int) -> None:
    k = len(ranks)

    def math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat([x.chunk(k, split_dim)[i] for x in xs], concat_dim) for i in range(k)]

    shape = (2 * k, 3 * k, k)
    rec = run_parity(n, ranks, shape, lambda g: sw.ops.AlltoAll(k, split_dim, concat_dim, g), math)
    assert rec.count("AlltoAll") == 2


@pytest.mark.parametrize("n", [2, 4, 8])
def test_neighbor_exchange_ring(n: int) -> None:
    def math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [xs[(r - 1) % n] for r in range(n)]

    def make(group: str | None) -> torch.nn.Module:
        rank = sw.communication.get_rank()
        return sw.ops.NeighborExchange([(rank + 1) % n], [(rank - 1) % n], [[2, 3]], [[2, 3]])

    rec = run_parity(n, list(range(n)), (2, 3), make, math, unpack=True)
    assert rec.count("NeighborExchange", "forward") == 1
    assert rec.count("NeighborExchange", "backward") == 1
    assert rec.records[0].bytes_sent == 2 * 3 * 4


def test_neighbor_exchange_two_tensors_both_ways() -> None:
    """Each rank sends `a` right and `b` left, and receives its neighbours' `a` and `b`."""
    n = 4
    with simulated_world(n) as world, CommRecorder() as rec:
        rank = sw.communication.get_rank()
        op = sw.ops.NeighborExchange(
            [(rank + 1) % n, (rank - 1) % n],
            [(rank - 1) % n, (rank + 1) % n],
            [[3], [2]],
            [[3], [2]],
        )
        a = world.rank_map(lambda r: torch.full((3,), float(r)))
        b = world.rank_map(lambda r: torch.full((2,), 10.0 + r))
        from_left, from_right = op((a, b))
        assert_matches_single_device(from_left, lambda r: torch.full((3,), float((r - 1) % n)))
        assert_matches_single_device(from_right, lambda r: torch.full((2,), 10.0 + (r + 1) % n))
    assert rec.records[0].bytes_sent == (3 + 2) * 4


def _grid_math(n: int, lens: int) -> tuple[list[list[int]], Math]:
    """2 x n/2 grid without wrap-around: neighbour ids per rank and the single-device halo."""
    cols = n // 2
    steps = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]

    def at(r: int, c: int) -> int:
        return r * cols + c if 0 <= r < 2 and 0 <= c < cols else -1

    ids = [[at(q // cols + dr, q % cols + dc) for dr, dc in steps] for q in range(n)]

    def math(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = []
        for q, x in enumerate(xs):
            _, _, h, w = x.shape
            y = torch.nn.functional.pad(x, (lens, lens, lens, lens))
            big = torch.zeros_like(y)
            src = {
                0: (
                    slice(0, lens),
                    slice(lens, lens + w),
                    lambda z, h=h, w=w: z[..., h - lens :, :],
                ),
                1: (
                    slice(0, lens),
                    slice(lens + w, None),
                    lambda z, h=h, w=w: z[..., h - lens :, :lens],
                ),
                2: (
                    slice(lens, lens + h),
                    slice(lens + w, None),
                    lambda z, h=h, w=w: z[..., :, :lens],
                ),
                3: (
                    slice(lens + h, None),
                    slice(lens + w, None),
                    lambda z, h=h, w=w: z[..., :lens, :lens],
                ),
                4: (
                    slice(lens + h, None),
                    slice(lens, lens + w),
                    lambda z, h=h, w=w: z[..., :lens, :],
                ),
                5: (
                    slice(lens + h, None),
                    slice(0, lens),
                    lambda z, h=h, w=w: z[..., :lens, w - lens :],
                ),
                6: (
                    slice(lens, lens + h),
                    slice(0, lens),
                    lambda z, h=h, w=w: z[..., :, w - lens :],
                ),
                7: (
                    slice(0, lens),
                    slice(0, lens),
                    lambda z, h=h, w=w: z[..., h - lens :, w - lens :],
                ),
            }
            parts = [y]
            for d, (rs, cs, cut) in src.items():
                peer = ids[q][d]
                if peer != -1:
                    block = torch.zeros_like(big)
                    block[..., rs, cs] = cut(xs[peer])
                    parts.append(block)
            outs.append(sum(parts[1:], parts[0]))
        return outs

    return ids, math


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("lens", [1, 2])
def test_neighbor_exchange_v2_grid(n: int, lens: int) -> None:
    ids, math = _grid_math(n, lens)

    def make(group: str | None) -> torch.nn.Module:
        sim = current_world()
        assert sim is not None
        per_rank = [sim.per_rank_int([ids[r][d] for r in range(n)]) for d in range(8)]
        return sw.ops.NeighborExchangeV2(per_rank, [lens] * 4, per_rank, [lens] * 4)

    rec = run_parity(n, list(range(n)), (2, 3, 4, 5), make, math)
    assert rec.count("NeighborExchangeV2", "forward") == 1
    assert rec.count("NeighborExchangeV2", "backward") == 1
