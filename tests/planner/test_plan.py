"""`planner.plan_semi_auto` and `ParallelPlan`: seed 003's network (int and Layout strategies),
the Megatron GPT block and nanoGPT planned without processes; printed, saved, loaded (equal),
diffed; a frozen parameter's record; plan-time errors; strategy files through `AutoParallel`."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.planner import (
    ParallelPlan,
    PlanError,
    StrategyFileError,
    capture,
    plan_semi_auto,
    plan_sharding_propagation,
)
from shardwise.testing import assert_matches_single_device, simulated_world
from shardwise.testing.models import GPTBlock, GPTConfig, megatron_strategies

from ..parallel.test_seed003_parity import Network
from ..zoo import GPT2, token_batches


def seed003_plan(layouts: bool) -> ParallelPlan:
    return plan_semi_auto(capture(Network(layouts), torch.zeros(32, 1, 28, 28)), 8)


@pytest.mark.parametrize("layouts", [False, True], ids=["int", "layout"])
def test_seed003_plan(layouts: bool, tmp_path: Path) -> None:
    plan = seed003_plan(layouts)
    assert [n.rule for n in plan.nodes] == ["default", "user", "user", "user", "user", "default"]
    text = str(plan)
    assert "matmul1/MatMul [shardwise.ops.MatMul; user]" in text
    # the strategies' own partial sums (seed 003: matmul1 splits K over 4, matmul2 over 8)
    sizes = dict(zip(plan.matrix.names, plan.matrix.shape, strict=True))
    own = {
        n.name: [(c.kind, c.detail, math.prod(sizes[a] for a in c.axes)) for c in n.comms]
        for n in plan.nodes
        if n.comms
    }
    assert own == {
        "matmul1/MatMul": [("AllReduce", "sum", 4)],
        "matmul2/MatMul": [("AllReduce", "sum", 8)],
    }
    assert plan.params["fc3_weight"].layout.used_axes() == ()
    plan.save(tmp_path / "plan.json")
    loaded = ParallelPlan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.diff(plan) == []
    assert str(loaded) == text


def test_a_frozen_parameter_is_in_the_plan_and_its_file(tmp_path: Path) -> None:
    """A parameter that requires no gradient is listed in `ParallelPlan.frozen`, printed and
    diffed, saved and loaded back equal (the file written again byte for byte); the first
    MatMul's output (of the input and the frozen weight) then needs no gradient. A plan
    without one writes no ``frozen`` field."""
    net = Network(False)
    net.fc1_weight.requires_grad_(False)
    plan = plan_semi_auto(capture(net, torch.zeros(32, 1, 28, 28)), 8)
    trainable = seed003_plan(False)
    assert plan.frozen == ("fc1_weight",) and trainable.frozen == ()
    assert "param fc1_weight: ((g1, g2), None) float32[784, 512] (frozen: no gradient)" in str(plan)
    assert "frozen" not in json.dumps(trainable.to_dict())
    assert plan.nodes[1].name == "matmul1/MatMul"
    assert "%1" in trainable.gradient_values() and "%1" not in plan.gradient_values()
    assert "param:fc2_weight" in plan.gradient_values()
    plan.save(tmp_path / "plan.json")
    loaded = ParallelPlan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.frozen == ("fc1_weight",)
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    assert plan.diff(trainable) == ["frozen parameters: ['fc1_weight'] -> []"]


def test_a_plan_is_frozen_all_the_way() -> None:
    """Its mappings are read-only too; a changed plan is a new one (``dataclasses.replace``),
    and copies (pickle, deepcopy, JSON) are equal and as frozen."""
    plan = seed003_plan(False)
    name = next(iter(plan.params))
    with pytest.raises(TypeError, match="frozen"):
        plan.params[name] = plan.params[name]  # type: ignore[index]
    with pytest.raises(TypeError, match="frozen"):
        plan.inputs.pop("args[0]")  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="frozen"):
        plan.equal_grads.update({})  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.params = {}  # type: ignore[misc]
    fewer = dataclasses.replace(plan, params={k: v for k, v in plan.params.items() if k != name})
    assert fewer != plan and name in plan.params and name not in fewer.params
    for copy in (
        pickle.loads(pickle.dumps(plan)),
        deepcopy(plan),
        ParallelPlan.from_dict(plan.to_dict()),
    ):
        assert copy == plan
        with pytest.raises(TypeError, match="frozen"):
            copy.params.clear()  # type: ignore[attr-defined]


def test_int_and_layout_plans_differ_where_the_strategies_do() -> None:
    diff = seed003_plan(False).diff(seed003_plan(True))
    assert any(d.startswith("node %1 matmul1/MatMul") for d in diff), diff
    assert not any("matmul3" in d for d in diff), diff


class _TwoMatMuls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 16))
        self.w2 = torch.nn.Parameter(torch.randn(16, 16))
        self.matmul = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.matmul2(torch.relu(self.matmul(x, self.w1)), self.w2)
        return out


def test_a_diff_names_outputs_and_inputs_in_the_plans_notation() -> None:
    """Sharding propagation returns matmul2's rows split over g0, semi_auto's default over
    (g0, g1); a batch of 32 rows differs from one of 16 in its input's shape: the diff says
    so as the plan prints placements, not as Python reprs."""
    net = _TwoMatMuls()
    graph, bigger = capture(net, torch.zeros(16, 16)), capture(net, torch.zeros(32, 16))
    propagated, semi = plan_sharding_propagation(graph, 8), plan_semi_auto(graph, 8)
    assert (str(propagated.outputs[0]), str(semi.outputs[0])) == ("(g0, None)", "((g0, g1), None)")
    lines = propagated.diff(semi)
    assert "outputs: (g0, None) -> ((g0, g1), None)" in lines
    assert "input args[0] shape: [16, 16] -> [32, 16]" in semi.diff(plan_semi_auto(bigger, 8))
    assert not [x for x in lines + semi.diff(plan_semi_auto(bigger, 8)) if "(layout=" in x]


def test_a_diff_of_plans_on_other_matrices_says_placements_name_their_own_axes() -> None:
    class Net(torch.nn.Module):
        def __init__(self, strategy: tuple[tuple[int, ...], ...]) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 8))
            self.matmul = sw.ops.MatMul().shard(strategy)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.matmul(x, self.w)
            return out

    x = torch.zeros(8, 16)
    two = plan_semi_auto(capture(Net(((2, 2), (2, 1))), x), 4)  # (rows over g0 x g1: 4 ways)
    one = plan_semi_auto(capture(Net(((4, 1), (1, 1))), x), 4)  # (rows over g0: 4 ways)
    lines = two.diff(one)
    assert lines[0].startswith("matrix: ") and "each plan's own axes" in lines[0], lines


def test_gpt_block_plan_round_trips() -> None:
    cfg = GPTConfig()
    net = GPTBlock(cfg, megatron_strategies(2, 4))
    ids, onehot = torch.zeros(8, cfg.seq, dtype=torch.long), torch.zeros(8 * cfg.seq, cfg.vocab)
    plan = plan_semi_auto(capture(net, ids, onehot), 8)
    # (2, 4): the embedding's ((mp, 1), (dp, 1)) has dp outer, mp inner, like every other op
    assert plan.matrix.shape == (2, 4)
    again = ParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    kinds = {c.kind for c in plan.collectives()}
    assert {"AllReduce", "AllGather", "AlltoAll"} <= kinds
    # equal gradients over mp (g1): the gradients of what the column-parallel q/k/v, fc1 and
    # head read are averaged over mp (Megatron's f), so the AllReduces that made those values
    # whole need no adjoint collective, nor the LayerNorms' and the position's gradients
    averaged = {n.name: [str(c) for c in n.backward] for n in plan.nodes if n.backward}
    assert averaged == {
        "ln1/LayerNorm": ["AllReduce(avg) over g1 at ln1/LayerNorm"],
        "ln2/LayerNorm": ["AllReduce(avg) over g1 at ln2/LayerNorm"],
        "res2/Add": ["AllReduce(avg) over g1 at res2/Add"],
    }
    local = {n.name: c.equal_grad for n in plan.nodes for c in n.comms if c.equal_grad}
    assert local == {"embed/Gather": ("g1",), "proj/MatMul": ("g1",), "fc2/MatMul": ("g1",)}
    replicated = ("position", "ln1_gamma", "ln1_beta", "ln2_gamma", "ln2_beta")
    assert dict(plan.equal_grads) == {n: (1,) for n in replicated}
    assert "backward local on g1" in str(plan) and "(gradient equal on g1)" in str(plan)


def test_nanogpt_plans_data_parallel_with_one_collective() -> None:
    ids = torch.zeros(8, 16, dtype=torch.long)
    plan = plan_semi_auto(capture(GPT2(), ids, ids), 4)
    assert [str(c) for c in plan.collectives()] == ["AllReduce(avg) over g0 at return 0"]
    view = plan.nodes[-3]
    assert view.op == "torch.Tensor.view" and str(view.outputs[0]) == "(g0, None)"
    assert view.local_shapes == ((32, 64),)


def test_a_batch_that_does_not_divide_is_a_plan_error() -> None:
    ids = torch.zeros(6, 16, dtype=torch.long)
    with pytest.raises(PlanError, match=r"input args\[0\]: dim 0 of global shape \[6, 16\].* 4"):
        plan_semi_auto(capture(GPT2(), ids, ids), 4)


class TwoMatMuls(torch.nn.Module):
    def __init__(self, first: tuple[Any, ...], second: tuple[Any, ...]) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(24, 48))
        self.w2 = torch.nn.Parameter(torch.randn(48, 24))
        self.m1 = sw.ops.MatMul().shard(first)
        self.m2 = sw.ops.MatMul().shard(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m2(self.m1(x, self.w1), self.w2)


@pytest.mark.parametrize("planner", [plan_semi_auto, plan_sharding_propagation])
def test_device_matrices_that_do_not_nest_name_both_ops_and_the_fix(
    planner: Callable[[Any, int], ParallelPlan],
) -> None:
    """Two annotations on 6 ranks, one cutting them into blocks of 2 consecutive ranks, the
    other into blocks of 3: no global matrix holds both. The error named only the matrices
    (semi_auto's list mixed in the unannotated ops' defaults)."""
    graph = capture(TwoMatMuls(((3, 2), (2, 1)), ((2, 3), (3, 1))), torch.zeros(24, 24))
    with pytest.raises(PlanError) as caught:
        planner(graph, 6)
    message = str(caught.value)
    assert message.startswith(
        "m1/MatMul with strategy ((3, 2), (2, 1)) has device matrix [3, 2, 1] and m2/MatMul "
        "with strategy ((2, 3), (3, 1)) has [2, 3, 1]: they do not nest"
    )
    assert "a block of 2 consecutive ranks does not tile a block of 3" in message
    assert "give both the same one (both (3, 2) or both (2, 3))" in message
    assert "a single axis of all devices (6, 1)" in message


def test_device_matrices_given_as_layouts_that_do_not_nest_are_named_as_given() -> None:
    """The message printed a Layout strategy as split counts (its aliases lost) and suggested
    the split counts (6, 1) where a Layout user writes a device matrix (6,)."""
    a, b = sw.Layout((3, 2), ("a", "b")), sw.Layout((2, 3), ("c", "d"))
    net = TwoMatMuls((a("a", "b"), a("b", "None")), (b("c", "d"), b("d", "None")))
    graph = capture(net, torch.zeros(24, 24))
    with pytest.raises(PlanError) as caught:
        plan_semi_auto(graph, 6)
    message = str(caught.value)
    assert message.startswith(
        "m1/MatMul with strategy (layout('a', 'b'), layout('b', 'None')) has device matrix "
        "[3, 2] and m2/MatMul with strategy (layout('c', 'd'), layout('d', 'None')) has [2, 3]: "
        "they do not nest"
    )
    assert "a single axis of all devices (a Layout of device matrix (6,)), which" in message


def step_of(net: torch.nn.Module, opt: torch.optim.Optimizer):  # type: ignore[no-untyped-def]
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_strategy_files_round_trip_and_mismatches(tmp_path: Path) -> None:
    (x, y), (x2, y2) = token_batches(2, 8)
    net = GPT2()
    with simulated_world(2) as world:
        world.replicate(net)
        first = sw.AutoParallel(step_of(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        want = first(world.rows(x), world.rows(y))
        first.save_operator_strategy_file(tmp_path / "ops.json")
        first.save_param_strategy_file(tmp_path / "params.json")
    net2 = GPT2()
    with simulated_world(2) as world:
        world.replicate(net2)
        again = sw.AutoParallel(step_of(net2, torch.optim.SGD(net2.parameters(), lr=0.1)))
        again.load_operator_strategy_file(tmp_path / "ops.json")
        again.load_param_strategy_file(tmp_path / "params.json")
        got = again(world.rows(x), world.rows(y))
        assert_matches_single_device(got, want.detach(), what="loss of the loaded plan")
        assert again.parallel_plan == ParallelPlan.load(tmp_path / "ops.json")
    net3, net4 = GPT2(), GPT2(n_layer=1)
    with simulated_world(4) as world:  # another device count
        world.replicate(net3)
        wrong = sw.AutoParallel(step_of(net3, torch.optim.SGD(net3.parameters(), lr=0.1)))
        wrong.load_operator_strategy_file(tmp_path / "ops.json")
        with pytest.raises(StrategyFileError, match=r"planned for 2 devices, the job has 4"):
            wrong(world.rows(x2), world.rows(y2))
    with simulated_world(2) as world:  # another network
        world.replicate(net4)
        other = sw.AutoParallel(step_of(net4, torch.optim.SGD(net4.parameters(), lr=0.1)))
        other.load_operator_strategy_file(tmp_path / "ops.json")
        with pytest.raises(StrategyFileError, match=r"op %\d+ is .* in the file but .* network"):
            other(world.rows(x2), world.rows(y2))


def _edit_fc1_weight(d: Any, **change: Any) -> Any:
    params = {k: dict(v) for k, v in d["params"].items()}
    params["fc1_weight"].update(change)
    return {**d, "params": params}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"groups": [2.5, 1]}, r"parameter 'fc1_weight': groups \[2\.5, 1\]: give one int >= 1"),
        ({"groups": ["a", 1]}, r"parameter 'fc1_weight': groups \['a', 1\]: give one int >= 1"),
        ({"dims": [[1.0], []]}, r"parameter 'fc1_weight': dims \[\[1\.0\], \[\]\]: give one"),
    ],
    ids=str,
)
def test_a_plan_files_non_int_layout_is_refused_not_cut(change: Any, message: str) -> None:
    """A group count 2.5 (or an axis 1.0) in an edited plan is refused, naming the parameter and
    the key; it was read as int(2.5) = 2, a strided layout the file does not say."""
    with pytest.raises(ValueError, match=message):
        ParallelPlan.from_dict(_edit_fc1_weight(seed003_plan(False).to_dict(), **change))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: {k: v for k, v in d.items() if k != "nodes"}, r"no field 'nodes'"),
        (lambda d: {**d, "nodes": "abc"}, r"a malformed shardwise plan \(string indices"),
        (lambda d: {**d, "matrix": [2, 2]}, r"a malformed shardwise plan"),
        (lambda d: [d], r"not a shardwise plan \(format 'list'"),
        (  # (a checkpointed region past the plan's nodes)
            lambda d: {
                **d,
                "regions": [{"first": 0, "last": 99, "until": 0, "full": True, "reentrant": False}],
            },
            r"a malformed shardwise plan \(region .* not a region of the plan's nodes",
        ),
        (
            lambda d: {**d, "frozen": ["fc1_weight", "no_such"]},
            r"a malformed shardwise plan \(frozen .* not a list of the plan's parameters",
        ),
    ],
)
def test_a_malformed_plan_is_a_value_error(edit: Callable[[Any], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelPlan.from_dict(edit(seed003_plan(False).to_dict()))
