"""A plan an automatic mode made (sharding_propagation, recursive_programming), saved with
`save_operator_strategy_file` and loaded by a fresh wrapper of the same network, mode and ranks:
it runs that plan (the same plan, the same collectives), equal to one device, without searching.

The loading job checked the file against a plan of its own made in semi_auto, whose equal
gradients (`ParallelPlan.equal_grads`) differ where the file's plan places the ops another way
(a head split over every axis needs its gradient summed over both): it refused the file with
"buckets differ ... use the same hsdp() / comm_fusion() settings" although they were the same.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import StrategyFileError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

STEPS, LR = 2, 0.1
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
Kinds = Counter[tuple[str, str, tuple[int, ...]]]


class Net(nn.Module):
    """Two annotated MatMuls and an unannotated head (placed by the mode)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.mm1 = sw.ops.MatMul().shard(((2, 1), (1, 2)))
        self.mm2 = sw.ops.MatMul().shard(((2, 2), (2, 1)))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.mm2(F.relu(self.mm1(x, self.w1)), self.w2)
        return F.cross_entropy(self.head(h), y)


def _single() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, params = [], []
    for _ in range(STEPS):
        loss = net(X, Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


def _train(mode: str, load: Path | None = None, fusion: bool = False) -> tuple[AutoParallel, Kinds]:
    """STEPS steps on 4 ranks checked against one device; the first step's collectives."""
    want, after = _single()
    net = Net()
    kinds: Kinds = Counter()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = AutoParallel(step, parallel_mode=mode)
        if fusion:
            parallel.comm_fusion({"openstate": False})
        if load is not None:
            parallel.load_operator_strategy_file(load)
        for s in range(STEPS):
            with CommRecorder() as rec:
                loss = parallel(world.rows(X), world.rows(Y))
            kinds = kinds or rec.kinds()
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
            plan = parallel.parallel_plan
            assert plan is not None
            for name, p in net.named_parameters():
                layout, shape = plan.param_layouts()[name]
                full = after[s][name]
                assert_matches_single_device(
                    p.detach(),
                    lambda r, f=full, a=layout, s=shape: f[a.local_slice(r, s)],
                    what=f"{name} after step {s}",
                )
    return parallel, kinds


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_a_saved_automatic_plan_loads_and_runs_as_saved(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, kinds = _train(mode)
    first.save_operator_strategy_file(tmp_path / "plan.json")

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched although a plan was loaded")

    from shardwise.parallel import _graph_capture

    monkeypatch.setitem(_graph_capture._PLANNERS, mode, no_search)
    again, kinds_again = _train(mode, load=tmp_path / "plan.json")
    assert again.parallel_plan == first.parallel_plan
    assert kinds_again == kinds


def test_a_file_of_other_fusion_settings_names_the_bucket(tmp_path: Path) -> None:
    """Buckets are compared with the ones this job's settings make for the file's plan: a job
    of other comm_fusion settings is named by its bucket."""
    first, _ = _train("sharding_propagation")
    first.save_operator_strategy_file(tmp_path / "plan.json")
    with pytest.raises(StrategyFileError, match=r"bucket 0: .* in the file, .* here\); use"):
        _train("sharding_propagation", load=tmp_path / "plan.json", fusion=True)
