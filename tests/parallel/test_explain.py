"""`AutoParallel.explain` on a semi_auto plan (it raised "no explained plan"): the strategy,
the rule it came from and what the op moves; the automatic modes' explanations with their
alternatives are tested in test_propagation_parity.py and tests/planner/test_search.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(32, 16))
        self.w2 = nn.Parameter(torch.randn(16, 8))
        self.mm1 = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.mm2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm2(torch.relu(self.mm1(x, self.w1)), self.w2)
        return out


def test_a_semi_auto_plan_explains_each_op() -> None:
    net, x = _Net(), torch.randn(16, 32)
    with simulated_world(8) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        with pytest.raises(ValueError, match="nothing planned yet"):
            parallel.explain("mm1/MatMul")
        parallel(world.rows(x))
        names = list(parallel.strategies())
    annotated = parallel.explain("mm1/MatMul")
    assert annotated.startswith("mm1/MatMul: ((2, 4), (4, 1)) (annotated: its shard() strategy)")
    assert "runs: AllReduce" in annotated  # (its K dim split over 4: partial sums reduced)
    assert "input moved:" in annotated  # (the rows arrive over 8 ranks, it takes them over 2)
    assert "semi_auto weighs no alternatives" in annotated
    default = parallel.explain("mm2/MatMul")
    assert default.startswith("mm2/MatMul: ((8, 1), (1, 1)) (a primitive's data-parallel")
    relu = next(n for n in names if "relu" in n)
    assert "not annotated: it takes its inputs as they come" in parallel.explain(relu)
    with pytest.raises(ValueError, match=r"no op 'mm1' in the plan; close: \['mm1/MatMul'"):
        parallel.explain("mm1")
    with pytest.raises(ValueError, match=r"no op 'zzzz' in the plan; its ops: \['mm1/MatMul'"):
        parallel.explain("zzzz")  # (nothing close: the plan's op names listed)
    with pytest.raises(ValueError, match=r"close: \['mm1/MatMul', 'mm2/MatMul'\]"):
        parallel.explain("mm")  # (names holding it, in the plan's order)
    with pytest.raises(ValueError, match=r"no op 'nope' in the plan; its ops: "):
        parallel.explain("nope")  # (no far-fetched suggestion)


def test_alternatives_show_their_placements() -> None:
    """The automatic modes list each alternative with its inputs' and outputs' placements:
    candidates whose split counts coincide (over another axis, or a partial output) printed
    alike, so the chosen line and another could not be told apart."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
        parallel = sw.AutoParallel(net, parallel_mode="sharding_propagation")
        parallel(world.rows(x))
    lines = parallel.explain("2/linear").splitlines()[1:]
    assert len(lines) > 1 and len({line.split(":")[0] for line in lines}) == len(lines), lines
    assert all(" [" in line and " -> " in line for line in lines), lines


def test_each_alternative_is_listed_once() -> None:
    """A torch op whose all-whole strategy came both from its sharding rule and from the
    run-it-whole fallback had two candidates placing everything alike (only the rule they came
    from differed): explain listed ``((1, 1), (1, 1), (1,)) [(None, None), ...]`` twice. They
    are one candidate now."""
    from .test_propagation_parity import moe_propagated

    parallel = moe_propagated()
    for e in range(4):
        lines = parallel.explain(f"experts.{e}/linear").splitlines()[1:]
        placed = [line.split(":")[0] for line in lines]
        assert len(lines) > 1 and len(set(placed)) == len(placed), lines


def test_data_parallel_mode_says_it_has_no_operator_plan() -> None:
    """After training in data_parallel mode: no plan because the mode makes none (the message
    said "nothing planned yet; call the wrapper" though it had run)."""
    net, x = torch.nn.Linear(4, 2), torch.randn(4, 4)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel")
        parallel(world.rows(x))
        assert parallel.has_run
        for read in (parallel.strategies, lambda: parallel.explain("linear")):
            with pytest.raises(ValueError, match="'data_parallel' runs no operator plan"):
                read()
