"""The reports count what activation checkpointing runs again in backward.

A checkpointed region's recomputation replays its nodes with their moves and collectives
(`parallel/_recompute.py`); ``execute.ir``, the dry run's traffic (`step_traffic`) and the step
estimate (`step_cost`) gave the numbers of a run without checkpointing (a helper's review: 21%
fewer bytes than a nanoGPT step sent). The capture notes each region and how far torch's
recomputation goes (`planner.Region`: every op when reentrant or without early stop, else up to
the op that saves its last tensor), and the reports count those collectives: equal to what a
4-rank simulated step records, on Megatron's column / row parallel block.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential, set_checkpoint_early_stop

import shardwise as sw
from shardwise.planner import CostModel, ParallelPlan, Region, step_cost
from shardwise.report._summary import step_traffic
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

HOW = {"none": None, "non-reentrant": False, "reentrant": True, "no early stop": False}


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        sw.shard(self.fc1, in_strategy=((2, 1), (2, 1)))  # column parallel
        sw.shard(self.fc2, in_strategy=((2, 2), (1, 2)))  # row parallel

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        reentrant = HOW[self.how]
        if reentrant is None:
            return self.head(self.block(h)).pow(2).mean()
        h = checkpoint(self.block, h, use_reentrant=reentrant)
        return self.head(h).pow(2).mean()


def run(
    how: str, root: Path, save: Path | None = None, load: Path | None = None
) -> tuple[ParallelPlan, CommRecorder]:
    net, x = Net(how), torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    sw.set_context(save_graphs=1, save_graphs_path=str(root))
    try:
        with simulated_world(4) as world, set_checkpoint_early_stop(how != "no early stop"):
            world.replicate(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)

            def step(a: torch.Tensor) -> torch.Tensor:
                loss = net(a)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss

            parallel = sw.AutoParallel(step)
            if load is not None:
                parallel.load_operator_strategy_file(load)
            parallel(world.rows(x))
            if save is not None:
                parallel.save_operator_strategy_file(save)
            with CommRecorder() as rec:
                parallel(world.rows(x))
    finally:
        sw.set_context(save_graphs=0, save_graphs_path="./saved_graph")
    plan = parallel.parallel_plan
    assert plan is not None
    return plan, rec


@pytest.mark.parametrize("how", list(HOW))
def test_reports_count_the_recomputed_collectives(how: str, tmp_path: Path) -> None:
    plan, rec = run(how, tmp_path)
    regions = {
        "none": (),
        "non-reentrant": (Region(1, 4, 3, False),),  # (fc2's matmul saves last: the add not)
        "reentrant": (Region(1, 4, 4, True, True),),
        "no early stop": (Region(1, 4, 4, True),),
    }[how]
    assert plan.regions == regions
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    mine = [r for r in rec.records if 0 in r.group]
    again = Counter(r.kind for r in mine if r.label.startswith("recompute from"))
    want = {"none": {}, "non-reentrant": {"AllGather": 1}}.get(
        how, {"AllGather": 1, "ReduceScatter": 1}
    )
    assert again == Counter(want)
    traffic = step_traffic(plan, 0, None)
    assert traffic.total == sum(r.bytes_sent for r in mine)
    assert Counter({k[1]: v for k, v in traffic.count.items() if k[0] == "recompute"}) == again
    assert step_cost(plan, CostModel()).collectives == len(rec.records)
    ir = (tmp_path / "rank_0" / "execute.ir").read_text()
    said = re.search(r"# bytes this rank sends in one backward.*: (\d+)", ir)
    assert said is not None
    backward = [r for r in mine if r.phase == "backward" and not r.label.startswith("bucket")]
    assert int(said.group(1)) == sum(r.bytes_sent for r in backward)
    assert all(str(r) in ir and str(r) in str(plan) for r in regions)


class TwoRegions(nn.Module):
    """Two checkpointed Megatron blocks reading one value: the second block's move of it reuses
    the first's in the forward (a shared edge), and runs again in its own replay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.a1, self.a2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.b1, self.b2 = nn.Linear(8, 16), nn.Linear(16, 8)
        for col, row in ((self.a1, self.a2), (self.b1, self.b2)):
            sw.shard(col, in_strategy=((2, 1), (2, 1)))
            sw.shard(row, in_strategy=((2, 2), (1, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        u = checkpoint(lambda t: self.a2(torch.relu(self.a1(t))), h, use_reentrant=False)
        v = checkpoint(lambda t: self.b2(torch.relu(self.b1(t))), h, use_reentrant=False)
        return self.head(u + v).pow(2).mean()


def sgd_step(net: nn.Module) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(a: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = net(a)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def test_a_shared_move_runs_again_in_a_later_region() -> None:
    net, x = TwoRegions(), torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(sgd_step(net))
        parallel(world.rows(x))
        with CommRecorder() as rec:
            parallel(world.rows(x))
    plan = parallel.parallel_plan
    assert plan is not None and len(plan.regions) == 2
    assert any(e.shared for e in plan.edges)
    again = [r for r in rec.records if r.label.startswith("recompute from")]
    assert len(again) == 2  # (each region's AllGather of h, the second one's too)
    assert step_cost(plan, CostModel()).collectives == len(rec.records)
    sent = sum(r.bytes_sent for r in rec.records if 0 in r.group)
    assert step_traffic(plan, 0, None).total == sent


def test_a_loaded_strategy_file_takes_this_steps_regions(tmp_path: Path) -> None:
    """Regions are the step's, not a strategy: a file saved without checkpointing, loaded for
    the checkpointed step, reports that step's replay (it kept the file's: none)."""
    run("none", tmp_path / "a", save=tmp_path / "plan.json")
    plan, rec = run("non-reentrant", tmp_path / "b", load=tmp_path / "plan.json")
    assert plan.regions == (Region(1, 4, 3, False),)
    assert step_cost(plan, CostModel()).collectives == len(rec.records)


class Primitives(nn.Module):
    """A checkpointed region of primitives: a row-parallel MatMul (its AllReduce inside the
    op, after the compute that saves) and an Add after it, which saves nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.mm = sw.ops.MatMul().shard(((1, 4), (4, 1)))
        self.add = sw.ops.Add()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: self.add(self.mm(t, self.w), t), x * 1.0, use_reentrant=False)
        out: torch.Tensor = h.pow(2).mean()
        return out


def test_a_region_of_primitives_replays_the_plan() -> None:
    """A region starting at a primitive replays the plan (its recomputation ran the primitive
    on the unmoved input: torch refused the recomputed shapes) and the gradient equals one
    device's; the MatMul's own AllReduce, after the compute that saves the region's last
    tensor, is not counted as recomputed (the reports equal what a step sends)."""
    net, x = Primitives(), torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref, other = Primitives(), Primitives()
    ref(x).backward()
    with simulated_world(4) as world:
        world.replicate(net)
        world.replicate(other)

        def grad_step(a: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = other(a)
            loss.backward()
            return loss

        first = sw.AutoParallel(grad_step)
        first(world.rows(x))
        layout, shape = first.parallel_plan.param_layouts()["w"]  # type: ignore[union-attr]
        want = ref.w.grad
        assert want is not None and other.w.grad is not None
        assert_matches_single_device(other.w.grad, lambda r: want[layout.local_slice(r, shape)])
        parallel = sw.AutoParallel(sgd_step(net))
        parallel(world.rows(x))
        with CommRecorder() as rec:
            parallel(world.rows(x))
    plan = parallel.parallel_plan
    assert plan is not None
    (region,) = plan.regions
    assert plan.nodes[region.until].op == "shardwise.ops.MatMul", plan.regions
    again = [r.kind for r in rec.records if r.label.startswith("recompute from")]
    assert again == ["AlltoAll"]  # (the input's move; not the MatMul's AllReduce)
    assert step_traffic(plan, 0, None).total == sum(r.bytes_sent for r in rec.records)
    # (the input's move has no adjoint: what it moves is computed from the input only)
    assert step_cost(plan, CostModel()).collectives == len(rec.records)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        sw.shard(self.fc1, in_strategy=((2, 1), (2, 1)))
        sw.shard(self.fc2, in_strategy=((2, 2), (1, 2)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + self.fc2(torch.relu(self.fc1(h)))
        return out


class Stack(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.body = nn.Sequential(_Block(), _Block(), _Block(), _Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.checkpointed:
            h = checkpoint_sequential(self.body, 2, h, use_reentrant=False)
        else:
            h = self.body(h)
        out: torch.Tensor = self.head(h).pow(2).mean()
        return out


@pytest.mark.parametrize("checkpointed", [True, False])
def test_level3_gathers_again_what_backward_and_a_replay_need(checkpointed: bool) -> None:
    """Level 3 gathers a bucket again in backward for a weight autograd saved or a region's
    recomputation reads (the fc2 biases: not saved, but replayed): the reports and step_cost
    count those AllGathers (they left out the replay's, and step_cost every level-3 one)."""
    net, x = Stack(checkpointed), torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(sgd_step(net)).hsdp(optimizer_level="level3", threshold=0)
        parallel(world.rows(x))
        with CommRecorder() as rec:
            parallel(world.rows(x))
    plan = parallel.parallel_plan
    assert plan is not None
    sent = sum(r.bytes_sent for r in rec.records if 0 in r.group)
    assert step_traffic(plan, 0, parallel.optimizer_plan).total == sent
    assert step_cost(plan, CostModel()).collectives == len(rec.records)
