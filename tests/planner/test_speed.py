"""The automatic planners' shortcuts give what the long way gives.

- Tied layers (`planner._tie`): on a 2- and 3-layer GPT-2 the tied plan equals the untied one
  (propagation on a 2-D matrix, and the search), and its cost is the untied optimum; on random
  problems the tied optimum equals brute force over tied assignments.
- DTensor asked per mesh dim (`ops._dtensor._per_axis`): on every aten call a GPT-2 plan asks
  about, on 2-D meshes, the combined per-dim answer (when there is one) equals DTensor's
  full-mesh answer.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from tests.zoo import GPT2
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

import shardwise.ops._dtensor as dt
import shardwise.ops.aten_rules as rules
from shardwise._torch.dtensor import has_single_dim_rule
from shardwise.planner import capture
from shardwise.planner._propagate import build_plan, propagate
from shardwise.planner._search import search
from shardwise.planner._solve import solve, total
from shardwise.planner._tie import _pattern, tie, untie

from .test_propagate import _random_problem


def _gpt(n_layer: int, batch: int = 4):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = GPT2(n_layer=n_layer, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    ids = torch.zeros(batch, 16, dtype=torch.long)
    return capture(net, ids, ids)


def test_layer_patterns() -> None:
    assert _pattern("transformer.h.3.attn.c_attn/linear") == "transformer.h.*.attn.c_attn/linear"
    assert _pattern("transformer.h.11/add_1") == "transformer.h.*/add_1"
    assert _pattern("transformer.h.2.ln_1.weight") == "transformer.h.*.ln_1.weight"
    assert _pattern("0/linear") == "*/linear"
    assert _pattern("transformer.wte/embedding") is None
    assert _pattern("attn/view_1") is None


@pytest.mark.parametrize("n_layer", [2, 3])
def test_tied_layers_plan_as_untied_propagation(n_layer: int) -> None:
    graph = _gpt(n_layer)
    runs = [propagate(graph, 4, extra_matrices=[(2, 2)], tie_layers=tied) for tied in (True, False)]
    assert runs[0].assignment == runs[1].assignment
    assert total(runs[0].problem, runs[0].assignment) == total(runs[1].problem, runs[1].assignment)
    plans = [build_plan(graph, r) for r in runs]
    assert plans[0].strategies() == plans[1].strategies()


def test_tied_layers_search_as_untied() -> None:
    graph = _gpt(2)
    tied, untied = (search(graph, 4, tie_layers=t) for t in (True, False))
    assert tied.totals == untied.totals
    assert tied.run.assignment == untied.run.assignment


def test_tied_problem_is_exact_for_tied_assignments() -> None:
    rng = random.Random(7)
    for _ in range(30):
        p = _random_problem(rng, rng.randint(3, 7), 2)
        # tie variables of equal domains pairwise, at random
        keys: list[object | None] = [None] * len(p.domains)
        for v in range(len(p.domains)):
            for u in range(v):
                if p.domains[u] == p.domains[v] and keys[u] is not None and rng.random() < 0.5:
                    keys[v] = keys[u]
                    break
            else:
                keys[v] = ("k", v) if rng.random() < 0.7 else None
        small, group = tie(p, keys)
        choice = untie(solve(small)[0], group)
        best = min(
            total(p, untie(a, group)) for a in itertools.product(*(range(d) for d in small.domains))
        )
        assert total(p, choice) == best
        assert all(
            choice[v] == choice[u]
            for u in range(len(p.domains))
            for v in range(u)
            if group[u] == group[v]
        )


def _queries(matrix: tuple[int, int]) -> list[tuple]:  # type: ignore[type-arg]
    """Every distinct (op, args, kwargs, out_shapes) a 1-layer propagation on `matrix` asks
    DTensor (each once: nearly half of the 796 asked are repeats)."""
    seen: list[tuple] = []  # type: ignore[type-arg]
    keys: set[object] = set()
    real = rules.propagate

    def spy(op, args, kwargs, mesh, out_shapes=None, out_meta=None):  # type: ignore[no-untyped-def]
        if mesh.ndim == 2 and out_shapes is not None:
            key = (op, dt._hashable(args, kwargs), tuple(map(tuple, out_shapes)))
            if key not in keys:
                keys.add(key)
                seen.append((op, args, kwargs, out_shapes))
        return real(op, args, kwargs, mesh, out_shapes, out_meta)

    rules.propagate = spy  # type: ignore[assignment]
    try:
        n = matrix[0] * matrix[1]
        propagate(_gpt(1, batch=n), n, extra_matrices=[matrix], tie_layers=False)
    finally:
        rules.propagate = real  # type: ignore[assignment]
    return seen


def _placing(wanted):  # type: ignore[no-untyped-def]
    def place(s: dt.Spec) -> dt.Spec:
        return dt.Spec(next(wanted), s.shape, s.stride, s.dtype)

    return place


@pytest.mark.parametrize("matrix", [(2, 2), (2, 4)])
def test_per_axis_answers_equal_dtensors_full_mesh(matrix: tuple[int, int]) -> None:
    """Each query as asked, and again with its inputs placed as DTensor wants them (the case
    the per-dim answer serves): wherever `_per_axis` answers, DTensor's full mesh agrees."""
    n = matrix[0] * matrix[1]
    mesh = dt.mesh_of(matrix, ("a", "b"), tuple(range(n)))
    checked = 0
    for op, args, kwargs, shapes in _queries(matrix):
        if not has_single_dim_rule(op):
            continue
        try:
            ins, _ = dt._full(op, args, kwargs, mesh)
        except (RuntimeError, NotImplementedError):
            continue
        moved = pytree.tree_map_only(dt.Spec, _placing(iter(ins)), (tuple(args), dict(kwargs)))
        for a, k in ((args, kwargs), moved):
            got = dt._per_axis(op, a, k, mesh, shapes)
            if got is not None:
                assert got == dt._full(op, a, k, mesh), (op, a, k)
                checked += 1
    assert checked > 20


@pytest.mark.parametrize("matrix", [(2, 2), (2, 4)])
def test_candidate_answers_are_strategies_dtensor_accepts(matrix: tuple[int, int]) -> None:
    """Inside `candidates` the per-dim answer may move inputs: with the inputs placed as it
    says, DTensor's full mesh moves nothing and gives the same outputs (it is one of its
    strategies), and outside `candidates` the answers are DTensor's own."""
    n = matrix[0] * matrix[1]
    mesh = dt.mesh_of(matrix, ("a", "b"), tuple(range(n)))
    loose = 0
    for op, args, kwargs, shapes in _queries(matrix) + _strided_queries(matrix):
        if not has_single_dim_rule(op):
            continue
        with dt.candidates():
            got = dt._per_axis(op, args, kwargs, mesh, shapes)
        if got is None:
            continue
        ins, outs = got
        given = [s.placements for s in pytree.tree_leaves((args, kwargs)) if isinstance(s, dt.Spec)]
        loose += ins != given
        placed = pytree.tree_map_only(dt.Spec, _placing(iter(ins)), (tuple(args), dict(kwargs)))
        assert dt._full(op, *placed, mesh) == (ins, outs), (op, args, kwargs)
        if ins != given:
            assert dt._per_axis(op, args, kwargs, mesh, shapes) is None
    assert loose > 5


def _strided_queries(matrix: tuple[int, int]) -> list[tuple]:  # type: ignore[type-arg]
    """Queries whose inputs hold DTensor's strided shards (a dim split by both axes, the
    second outermost: what a view of ``[B, T, C]`` split on T by one axis and on B by the other
    gives), as the search meets them on large matrices."""
    b = matrix[1]
    strided = (_StridedShard(0, split_factor=b), Shard(0))
    x = dt.Spec(strided, (64, 32), (32, 1), "float32")
    w = dt.Spec((Replicate(), Shard(1)), (32, 48), (1, 32), "float32")
    bias = dt.Spec((Replicate(), Replicate()), (48,), (1,), "float32")
    y = dt.Spec((Replicate(), Shard(0)), (64, 32), (32, 1), "float32")
    aten = torch.ops.aten
    return [
        (aten.addmm.default, (bias, x, w), {}, [(64, 48)]),
        (aten.mm.default, (x, w), {}, [(64, 48)]),
        (aten.add.Tensor, (x, y), {}, [(64, 32)]),
        (aten.add.Tensor, (x, x), {}, [(64, 32)]),
        (aten.gelu.default, (x,), {}, [(64, 32)]),
    ]
