"""`planner.plan_sharding_propagation` without processes: what it chooses, and that its solver
is exact.

- Seed 002: with matmul annotated ``((2, 4), (4, 1))``, relu takes ``(2, 4)`` and matmul2
  ``((2, 4), (4, 1))``, as the seed's IR shows; nothing annotated gives the data-parallel plan.
- Chains, a diamond, a parameter two ops share, torch ops after a primitive: the strategies
  checked against the unique zero-redistribution answer.
- The solver (`planner._solve`): on random problems the tree DP and the ILP equal brute force,
  and neither is worse than MindSpore's greedy breadth-first order.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import (
    PlanError,
    capture,
    plan_recursive_programming,
    plan_semi_auto,
    plan_sharding_propagation,
)
from shardwise.planner._solve import Problem, brute_force, greedy, solve, total
from shardwise.report import format_plan_execute


class Seed002(nn.Module):
    """Seed 002's network: MatMul, ReLU, MatMul (in 32, hidden 16, out 16)."""

    def __init__(self, annotate: bool = True, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(32, hidden) * 0.1)
        self.weight2 = nn.Parameter(torch.randn(hidden, 16) * 0.1)
        self.matmul = sw.ops.MatMul()
        if annotate:
            self.matmul.shard(((2, 4), (4, 1)))
        self.relu = sw.ops.ReLU()
        self.matmul2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.matmul2(self.relu(self.matmul(x, self.weight)), self.weight2)
        return out


def test_seed002_propagates_as_mindspore() -> None:
    plan = plan_sharding_propagation(capture(Seed002(), torch.zeros(16, 32)), 8)
    assert plan.mode == "sharding_propagation"
    assert plan.strategies() == {
        "matmul/MatMul": ((2, 4), (4, 1)),
        "relu/ReLU": ((2, 4),),
        "matmul2/MatMul": ((2, 4), (4, 1)),
    }
    assert [n.rule for n in plan.nodes] == ["user", "propagated", "propagated"]
    execute = format_plan_execute(plan, 0)
    assert "AllReduce(sum) over g1 at matmul/MatMul group [0, 1, 2, 3]" in execute
    assert "AllReduce(sum) over g1 at matmul2/MatMul group [0, 1, 2, 3]" in execute
    (edge,) = [e for e in plan.edges if e.consumer == 1]
    assert [type(s).__name__ for s in edge.steps] == ["Slice"]  # the seed's StridedSlice


def test_nothing_annotated_is_data_parallel() -> None:
    graph = capture(Seed002(annotate=False), torch.zeros(16, 32))
    plan = plan_sharding_propagation(graph, 8)
    assert set(plan.strategies().values()) == {((8, 1), (1, 1)), ((8, 1),)}
    assert plan.collectives() == []
    dp = plan_semi_auto(graph, 8)
    assert [(n.inputs, n.outputs) for n in plan.nodes] == [(n.inputs, n.outputs) for n in dp.nodes]


class TorchMLP(nn.Module):
    """A primitive MatMul annotated column-parallel, then torch ops: relu, a residual add of
    the relu to itself scaled, and F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64))
        self.fc = nn.Linear(64, 8)
        self.mm = sw.ops.MatMul().shard(((1, 1), (1, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mm(x, self.w))
        h = h + 0.5 * h  # (a diamond: two paths from h join)
        out: torch.Tensor = self.fc(h)
        return out


def test_torch_ops_follow_a_column_parallel_primitive() -> None:
    """relu, the scaled add and the linear's input keep the hidden dim split over the 4
    devices (no redistribution before the linear, whose contraction is split: a partial sum)."""
    plan = plan_sharding_propagation(capture(TorchMLP(), torch.zeros(8, 32)), 4)
    got = plan.strategies()
    assert got["mm/MatMul"] == ((1, 1), (1, 4))
    assert got["relu"] == ((1, 4),)
    assert got["mul"] == ((1, 4),) and got["add"] == ((1, 4), (1, 4))
    assert got["fc/linear"] == ((1, 4), (1, 4), (1,))
    moved = [e for e in plan.edges if e.consumer > 0 and e.steps]  # (x is gathered for mm)
    assert moved == []


class SharedWeight(nn.Module):
    """Two MatMuls read one weight; the first is annotated to split it by rows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.a = sw.ops.MatMul().shard(((1, 4), (4, 1)))
        self.b = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x, self.w), self.w)
        return out


def test_a_shared_parameter_is_stored_once_for_both_ops() -> None:
    plan = plan_sharding_propagation(capture(SharedWeight(), torch.zeros(8, 16)), 4)
    assert plan.strategies()["b/MatMul"] == ((1, 4), (4, 1))
    assert plan.params["w"].layout.dims == ((0,), ())
    assert [e for e in plan.edges if e.value == "param:w"] == []


def test_greedy_is_never_better_on_the_seed_network() -> None:
    from shardwise.planner._propagate import propagate

    graph = capture(Seed002(), torch.zeros(16, 32))
    exact = propagate(graph, 8)
    fast = propagate(graph, 8, method="greedy")
    assert total(exact.problem, exact.assignment) <= total(fast.problem, fast.assignment)


def _random_problem(rng: random.Random, n: int, cycles: bool, offset: int = 0) -> Problem:
    """A random tree of `n` variables (1-4 candidates each), plus, with `cycles`, a chain
    closed into a cycle; edge costs `offset` + 0..9 (large offsets make HiGHS's default
    relative gap visible)."""
    domains = [rng.randint(1, 4) for _ in range(n)]
    unary = [[(0, rng.randint(0, 3), rng.randint(0, 2)) for _ in range(d)] for d in domains]
    p = Problem(domains, unary)
    if cycles:
        links = [(v - 1, v) for v in range(1, n)] + [(0, n - 1)]
    else:
        links = [(rng.randrange(v), v) for v in range(1, n)]
    for u, v in links:
        cost = [
            [(offset + rng.randint(0, 9), 0, rng.randint(0, 1)) for _ in range(domains[v])]
            for _ in range(domains[u])
        ]
        p.link(u, v, cost)
    return p


@pytest.mark.parametrize(
    ("cycles", "offset"),
    [(False, 0), (True, 0), (True, 10_000_000)],
    ids=["tree", "cycles", "cycles-large-costs"],
)
def test_the_solver_is_exact_and_never_worse_than_greedy(cycles: bool, offset: int) -> None:
    rng = random.Random(offset + cycles)
    for _ in range(40):
        p = _random_problem(rng, rng.randint(4, 7), cycles, offset)
        choice, method = solve(p)
        assert method == ("ilp" if cycles else "tree")
        assert total(p, choice) == total(p, brute_force(p))
        assert total(p, choice) <= total(p, greedy(p))


def test_a_torch_mlp_with_nothing_annotated_is_data_parallel() -> None:
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x), y)

    graph = capture(step, torch.zeros(8, 16), torch.zeros(8, dtype=torch.long), networks=[net])
    plan = plan_sharding_propagation(graph, 4)
    dp = plan_semi_auto(graph, 4)
    assert plan.strategies() == dp.strategies()
    assert [str(c) for c in plan.collectives()] == [str(c) for c in dp.collectives()]


def test_each_choice_is_explained() -> None:
    """Every op says where its strategy came from and what the alternatives cost; the IR's
    step_parallel_begin ends with the same section."""
    from shardwise.report import format_plan_begin

    plan = plan_sharding_propagation(capture(Seed002(), torch.zeros(16, 32)), 8)
    relu = plan.explained["relu/ReLU"]
    assert relu.strategy == ((2, 4),)
    assert relu.source == "propagated from matmul/MatMul (annotated)"
    assert plan.explained["matmul/MatMul"].source == "annotated"
    best, *others = relu.alternatives
    assert best.chosen and best.strategy == ((2, 4),) and best.comm_s == 0.0
    eight = next(a for a in others if a.strategy == ((8, 1),))
    assert eight.comm_s > 0  # (matmul2's (2, 4) input would need an AlltoAll)
    assert eight.memory == best.memory and eight.compute == best.compute
    whole = next(a for a in others if a.strategy == ((1, 1),))
    assert whole.compute == 8 * best.compute and whole.memory == 8 * best.memory
    text = format_plan_begin(plan)
    assert "# sharding_propagation: why each op has its strategy" in text
    assert "  relu/ReLU: ((2, 4),) (propagated from matmul/MatMul (annotated))" in text
    nothing = plan_sharding_propagation(capture(Seed002(annotate=False), torch.zeros(16, 32)), 8)
    source = nothing.explained["relu/ReLU"].source
    assert source == "propagated from the dataset strategy (the inputs' placement)"


def test_contradictory_annotations_are_named() -> None:
    net = SharedWeight()
    net.b.shard(((1, 1), (1, 4)))  # w by columns here, by rows in `a`
    with pytest.raises(PlanError, match=r"contradictory annotations: parameter 'w' is read as "):
        plan_sharding_propagation(capture(net, torch.zeros(8, 16)), 4)


class OutStrategy(nn.Module):
    """A MatMul whose out_strategy asks for a ReduceScatter onto rows, feeding a diamond of
    unannotated ops (relu and mul of the same value, then add)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))
        self.mm = sw.ops.MatMul().shard(((1, 8), (8, 1)), out_strategy=((8, 1),))
        self.relu, self.mul, self.add = sw.ops.ReLU(), sw.ops.Mul(), sw.ops.Add()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mm(x, self.w)
        out: torch.Tensor = self.add(self.relu(h), self.mul(h, h))
        return out


class Broadcast(nn.Module):
    """``[32, C] - [32, 1]`` (Sub, unannotated) before a ReLU annotated ``(2, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.sub, self.relu = sw.ops.Sub(), sw.ops.ReLU().shard(((2, 4),))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.sub(x, y))
        return out


class Heads(nn.Module):
    """Attention heads: q projected column-parallel (annotated), k unannotated, both reshaped
    to heads and transposed, BatchMatMul, Softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk = nn.Parameter(torch.randn(32, 32)), nn.Parameter(torch.randn(32, 32))
        self.q = sw.ops.MatMul().shard(((2, 1), (1, 4)))
        self.k = sw.ops.MatMul()
        self.r1, self.r2 = sw.ops.Reshape(), sw.ops.Reshape()
        self.t1, self.t2 = sw.ops.Transpose(), sw.ops.Transpose()
        self.bmm, self.softmax = sw.ops.BatchMatMul(transpose_b=True), sw.ops.Softmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.t1(self.r1(self.q(x, self.wq), (8, 4, 4, 8)), (0, 2, 1, 3))
        k = self.t2(self.r2(self.k(x, self.wk), (8, 4, 4, 8)), (0, 2, 1, 3))
        out: torch.Tensor = self.softmax(self.bmm(q, k))
        return out


def test_propagation_through_common_patterns() -> None:
    """An out_strategy's rows feed the diamond with no move; a broadcast Sub keeps its
    [32, 1] input's rows split like the other's; attention heads stay split over the 4-device
    axis through reshape, transpose, BatchMatMul and Softmax, and k is projected the same way
    without moving q."""
    plan = plan_sharding_propagation(capture(OutStrategy(), torch.zeros(16, 16)), 8)
    assert {k: v for k, v in plan.strategies().items() if k != "mm/MatMul"} == {
        "relu/ReLU": ((8, 1),),
        "mul/Mul": ((8, 1), (8, 1)),
        "add/Add": ((8, 1), (8, 1)),
    }
    assert [e for e in plan.edges if e.consumer > 0] == []
    plan = plan_sharding_propagation(
        capture(Broadcast(), torch.zeros(32, 8), torch.zeros(32, 1)), 8
    )
    assert plan.strategies()["sub/Sub"] == ((8, 1), (8, 1))
    plan = plan_sharding_propagation(capture(Heads(), torch.zeros(32, 32)), 8)
    got = plan.strategies()
    assert got["t1/Transpose"] == got["t2/Transpose"] == ((2, 1, 4, 1),)
    assert got["bmm/BatchMatMul"] == ((2, 4, 1, 1), (2, 4, 1, 1))
    assert got["softmax/Softmax"] == ((2, 4, 1, 1),)
    assert [e for e in plan.edges if e.consumer > 4 and e.steps] == []  # (heads never move)


class Chain(nn.Module):
    """A parameter through four elementwise ops into a MatMul annotated to split its input's
    columns (and a buffer and a constant read by torch ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 16))
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("scale", torch.ones(16))
        self.offset = torch.ones(16)  # (a constant the capture records)
        self.mm = sw.ops.MatMul().shard(((1, 4), (4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(torch.tanh(torch.relu(self.p * 2.0)))
        out: torch.Tensor = self.mm(h, self.w) * self.scale + self.offset + x
        return out


def test_annotations_propagate_backwards_through_chains() -> None:
    """The MatMul's column split travels back through sigmoid, tanh, relu and the scaling to
    the parameter's storage (each op computes a quarter; no move anywhere); buffers and
    constants read by torch ops are whole on every rank."""
    graph = capture(Chain(), torch.zeros(8, 16))
    for plan in (plan_sharding_propagation(graph, 4), plan_recursive_programming(graph, 4)):
        got = plan.strategies()
        assert got["mul"] == got["relu"] == got["tanh"] == got["sigmoid"] == ((1, 4),)
        assert plan.params["p"].layout.dims == ((), (0,))


def test_candidates_that_split_a_dim_unevenly_are_dropped() -> None:
    """DTensor allows uneven shards (a 48-wide dim over a 32-device axis); shardwise's blocks
    are equal, so such candidates are dropped instead of failing the plan."""
    from ..zoo import GPT2

    net = GPT2(n_layer=1, n_embd=48, n_head=4, vocab_size=64, block_size=8)
    ids = torch.zeros(64, 8, dtype=torch.long)
    plan = plan_sharding_propagation(capture(net, ids, ids), 64, extra_matrices=[(2, 32)])
    for n in plan.nodes:
        for placed, shape in zip(n.outputs, n.shapes, strict=True):
            assert all(s % placed.layout.split_count(d) == 0 for d, s in enumerate(shape)), n


def test_gpt2_small_column_parallel_over_every_device_plans() -> None:
    """A regression: GPT-2 small's c_attn / c_fc split over all 8 devices made the ILP's third
    (tie-break) solve infeasible, HiGHS's float optimum of the second one lying below every
    integer point; each solve now keeps its component at the assignment's own exact value."""
    from tests.zoo import GPT2

    with torch.device("meta"):
        net = GPT2(n_layer=1, n_embd=768, n_head=12, vocab_size=50304, block_size=1024)
    for block in net.transformer.h:
        sw.shard(block.attn.c_attn, in_strategy=((1, 1), (8, 1)))
        sw.shard(block.mlp.c_fc, in_strategy=((1, 1), (8, 1)))
    ids = torch.zeros(16, 1024, dtype=torch.long)
    plan = plan_sharding_propagation(capture(net, ids, ids), 8)
    assert plan.strategies()["transformer.h.0.attn.c_attn/linear"] == ((1, 1, 1), (8, 1), (8,))


def test_an_op_between_an_annotation_and_the_loss_names_the_source_it_follows() -> None:
    """matmul2 is a link nearer the loss (which reads the targets) than the annotated matmul,
    but takes matmul's strategy handed on through relu without a move: it is matmul's."""
    net = Seed002()
    graph = capture(
        lambda x, y: F.mse_loss(net(x), y), torch.zeros(16, 32), torch.zeros(16, 16),
        networks=[net],
    )  # fmt: skip
    plan = plan_sharding_propagation(graph, 8)
    explained = plan.explained["matmul2/MatMul"]
    assert explained.strategy == ((2, 4), (4, 1))
    assert explained.source == "propagated from matmul/MatMul (annotated)"
    loss = plan.explained["mse_loss"]
    assert loss.source == "propagated from the dataset strategy (the inputs' placement)"
