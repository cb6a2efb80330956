"""The planner against brute force: every pair of layouts of a (8, 8, 8) tensor on the (2, 2, 2)
device matrix (each axis on a dim or on none, every order of the axes within a dim: 106
layouts, 11,236 pairs), and sampled pairs on matrices with other axis sizes.

The brute force below is written independently of the planner: its own layout enumeration,
its own step rules and cost model, and a layered search over all step sequences. It keeps, per
layout, the least (bytes, steps) over every sequence of at most d steps, for d = 0, 1, 2, ...
Costs are never negative, so some optimal sequence visits no layout twice and d = (number of
layouts - 1) suffices; the search stops earlier at a fixed point (a layer that improves nothing
means no later layer can, since each layer is computed from the previous one alone).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import permutations, product

import pytest

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution import (
    AllGather,
    AlltoAll,
    Slice,
    apply_step,
    plan_redistribution,
)

ITEMSIZE = 4
Dims = tuple[tuple[int, ...], ...]
Move = tuple[str, ...]  # ("Slice", dim, axis) | ("AllGather", dim, axis) | ("AlltoAll", ...)


@dataclass(frozen=True)
class Grid:
    """A device matrix's axis sizes and a global tensor shape: the brute force's whole world."""

    sizes: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def matrix(self) -> DeviceMatrix:
        return DeviceMatrix(self.sizes, tuple(f"a{i}" for i in range(len(self.sizes))))

    def fits(self, dims: Dims) -> bool:
        return all(
            n % math.prod(self.sizes[a] for a in axes) == 0
            for n, axes in zip(self.shape, dims, strict=True)
        )

    def block_bytes(self, dims: Dims) -> int:
        parts = [math.prod(self.sizes[a] for a in axes) for axes in dims]
        return ITEMSIZE * math.prod(n // p for n, p in zip(self.shape, parts, strict=True))


def all_layouts(grid: Grid) -> list[Dims]:
    """Each axis to one dim or none, with every order of the axes sharing a dim (those that
    divide the shape)."""
    out: set[Dims] = set()
    ndim = len(grid.shape)
    for assign in product([None, *range(ndim)], repeat=len(grid.sizes)):
        groups = [[a for a, d in enumerate(assign) if d == dim] for dim in range(ndim)]
        for orders in product(*(permutations(g) for g in groups)):
            out.add(tuple(tuple(o) for o in orders))
    return sorted(d for d in out if grid.fits(d))


GRID = Grid((2, 2, 2), (8, 8, 8))
MATRIX = DeviceMatrix(GRID.sizes, ("dp", "sp", "mp"))
LAYOUTS = all_layouts(GRID)


def moves(grid: Grid, dims: Dims) -> Iterator[tuple[Move, Dims, int]]:
    """Every single step from `dims`: (name, next layout, bytes each rank sends)."""
    s = grid.block_bytes(dims)
    used = {a for axes in dims for a in axes}
    for d, axes in enumerate(dims):
        for a in range(len(grid.sizes)):
            if a not in used:
                nxt = tuple((*ax, a) if i == d else ax for i, ax in enumerate(dims))
                if grid.fits(nxt):
                    yield ("Slice", str(d), str(a)), nxt, 0
        if not axes:
            continue
        a, k = axes[-1], grid.sizes[axes[-1]]
        gathered = tuple(ax[:-1] if i == d else ax for i, ax in enumerate(dims))
        yield ("AllGather", str(d), str(a)), gathered, (k - 1) * s
        for e in range(len(grid.shape)):
            if e != d:
                nxt = tuple((*ax, a) if i == e else ax for i, ax in enumerate(gathered))
                if grid.fits(nxt):
                    yield ("AlltoAll", str(a), str(d), str(e)), nxt, (k - 1) * s // k


@functools.cache
def brute_force(grid: Grid, src: Dims) -> dict[Dims, tuple[int, int]]:
    """Least (bytes, steps) from `src` to every layout over all step sequences."""
    best = {src: (0, 0)}
    for _ in range(len(all_layouts(grid))):  # provably enough: see the module docstring
        layer = dict(best)
        for dims, (cost, steps) in best.items():
            for _, nxt, c in moves(grid, dims):
                cand = (cost + c, steps + 1)
                if nxt not in layer or cand < layer[nxt]:
                    layer[nxt] = cand
        if layer == best:
            return best
        best = layer
    raise AssertionError("the search did not reach a fixed point within the proven depth")


def as_move(step: object) -> Move:
    if isinstance(step, Slice):
        return ("Slice", str(step.dim), str(step.axis))
    if isinstance(step, AllGather):
        return ("AllGather", str(step.dim), str(step.axis))
    assert isinstance(step, AlltoAll)
    return ("AlltoAll", str(step.axis), str(step.src_dim), str(step.dst_dim))


def check_pair(grid: Grid, matrix: DeviceMatrix, src: Dims, dst: Dims) -> None:
    """The plan's (bytes, steps) is the brute force's least; each step is a legal move of the
    brute force's rules with the same cost; the pure `apply_step` walks the layouts to `dst`."""
    plan = plan_redistribution(TensorLayout(matrix, src), TensorLayout(matrix, dst), grid.shape)
    want = brute_force(grid, src)[dst]
    got = (plan.total_bytes, len(plan.steps))
    assert got == want, f"{src} -> {dst}: plan {got}, brute force {want}"
    dims, layout = src, TensorLayout(matrix, src)
    for step, cost, after in zip(plan.steps, plan.step_bytes, plan.layouts, strict=True):
        legal = {name: (nxt, c) for name, nxt, c in moves(grid, dims)}
        assert as_move(step) in legal, f"{src} -> {dst}: {step} is not legal from {dims}"
        dims, want_cost = legal[as_move(step)]
        assert cost == want_cost, f"{src} -> {dst}: {step} costs {cost}, brute force {want_cost}"
        layout = apply_step(layout, step)
        assert layout == after and layout.dims == dims
    assert dims == dst and layout == TensorLayout(matrix, dst)


def test_layout_count() -> None:
    # k axes used: C(3, k) * k! * C(k + 2, 2) layouts -> 1 + 9 + 36 + 60
    assert len(LAYOUTS) == 106
    assert len({TensorLayout(MATRIX, d) for d in LAYOUTS}) == 106


@pytest.mark.parametrize("first", range(0, len(LAYOUTS), 27), ids=lambda i: f"src{i}")
def test_every_pair_is_minimal(first: int) -> None:
    for src in LAYOUTS[first : first + 27]:
        assert set(brute_force(GRID, src)) == set(LAYOUTS)
        for dst in LAYOUTS:
            check_pair(GRID, MATRIX, src, dst)


@pytest.mark.parametrize(
    "grid",
    [
        Grid((2, 4), (8, 4, 12)),  # uneven axes, dims that take only some splits
        Grid((4, 2, 3), (24, 12, 6)),
        Grid((3, 1, 2), (6, 6, 4)),  # an axis of size 1
    ],
    ids=str,
)
def test_other_matrices_sampled(grid: Grid) -> None:
    """Other axis sizes and shapes where divisibility prunes layouts: 400 sampled pairs."""
    layouts = all_layouts(grid)
    rng = random.Random(0)
    for _ in range(400):
        check_pair(grid, grid.matrix, rng.choice(layouts), rng.choice(layouts))
