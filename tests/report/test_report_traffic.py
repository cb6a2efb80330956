"""What the reports say a step sends equals what it sends (`CommRecorder`, rank 0's groups):
a ResNet in semi_auto on 4 simulated ranks, whose training batch norms gather their statistics
inside the op (9 AllGathers forward, their ReduceScatters backward: the plan lists them, with
their bytes) and whose mean loss's AllReduce carries the pair (mean x count, count) in float32
(12 bytes at 4 ranks, not one element of the loss). A loss an op's own AllReduce makes whole
(``sw.ops.ReduceMean``) has no adjoint in ``loss.backward()``, and the reports count none. A
first layer of a frozen weight runs no backward collectives, and the reports list none."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

import shardwise as sw
from shardwise.context import set_context
from shardwise.planner import CostModel, step_cost
from shardwise.report import format_plan_execute, memory_tensors
from shardwise.report._summary import step_traffic
from shardwise.testing import CommRecorder, simulated_world

from ..zoo import ResNet, image_batches


def test_a_resnet_step_sends_what_the_reports_say() -> None:
    (x, y), net = image_batches(1, 8)[0], ResNet()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        parallel(world.rows(x), world.rows(y))
        with CommRecorder() as rec:
            parallel(world.rows(x), world.rows(y))
    plan = parallel.parallel_plan
    assert plan is not None
    traffic = step_traffic(plan, 0, None)
    assert traffic.total == rec.total_bytes(), rec.summary()
    said: Counter[str] = Counter()
    for (_, kind, _), sent in traffic.sent.items():
        said[kind] += sent
    ran: Counter[str] = Counter()
    for r in rec.records:
        ran[r.kind] += r.bytes_sent
    assert said == ran, rec.summary()
    norms = [c for c in plan.collectives() if c.detail == "batch statistics"]
    assert len(norms) == 9 and {c.kind for c in norms} == {"AllGather"}
    text = format_plan_execute(plan, 0)
    assert "AllGather(batch statistics) over g0 at stem.1/batch_norm" in text
    assert "at return 0 group [0, 1, 2, 3] fusion 0 send_bytes 12" in text


def test_data_parallel_mode_writes_its_plan(tmp_path: Path) -> None:
    """``parallel_mode="data_parallel"`` with ``save_graphs``: each rank's ``execute.ir`` holds
    the runner's plan (owners, fusion ids, buckets, collectives per step); it wrote nothing."""
    net, x = torch.nn.Linear(4, 2), torch.randn(4, 4)
    try:
        set_context(save_graphs=1, save_graphs_path=str(tmp_path))
        with simulated_world(2) as world:
            world.replicate(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)

            def step(a: torch.Tensor) -> torch.Tensor:
                loss = net(a).square().mean()
                loss.backward()
                opt.step()
                return loss

            sw.AutoParallel(step, parallel_mode="data_parallel")(world.rows(x))
    finally:
        set_context(save_graphs=0, save_graphs_path="./saved_graph")
    for r in range(2):
        text = (tmp_path / f"rank_{r}" / "execute.ir").read_text()
        assert text.startswith("# execute: data_parallel on 2 ranks")
        assert "weight" in text and "per step: 2 AllReduce, 0 Broadcast" in text  # (+ the loss)


def test_level_3_regathers_only_the_weights_autograd_saves() -> None:
    """hsdp level 3 gathers a bucket again in backward only for a weight autograd saved. The
    first linear's two parameters are the only sharded bucket (the second's 10 rows do not
    split over 4 ranks), and its weight is not saved (its input needs no gradient; its bias
    needs one, but a bias is added, not multiplied): no AllGather in backward, and the
    reported bytes equal the recorder's (the report counted a second one)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = torch.nn.functional.cross_entropy(net(a), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step).hsdp(threshold=0, optimizer_level="level3")
        parallel(world.rows(x), world.rows(y))
        with CommRecorder() as rec:
            parallel(world.rows(x), world.rows(y))
    plan = parallel.parallel_plan
    assert plan is not None
    traffic = step_traffic(plan, 0, parallel.optimizer_plan)
    assert traffic.total == rec.total_bytes(), rec.summary()
    gathers = [r for r in rec.records if r.kind == "AllGather"]
    assert Counter(r.phase for r in gathers) == Counter({"forward": 1}), rec.summary()


class _MeanLoss(torch.nn.Module):
    """A MatMul of row-split inputs, ReLU, then ``sw.ops.ReduceMean`` over the split rows: the
    loss made whole by the ReduceMean's own AllReduce over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.mm = sw.ops.MatMul().shard(((2, 1), (1, 1)))
        self.relu = sw.ops.ReLU().shard(((2, 1),))
        self.mean = sw.ops.ReduceMean().shard(((2, 1),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mean(self.relu(self.mm(x, self.w)))
        return out


def test_a_loss_an_ops_own_allreduce_makes_has_no_backward_collective() -> None:
    """A loss made whole by ``sw.ops.ReduceMean``'s own AllReduce, ``loss.backward()`` on it:
    backward starts there and sends nothing for it (the seed is the same on every rank). The
    backward section of execute.ir lists its adjoint marked none and counts only what runs,
    and the step's traffic and the step estimate's collectives are the recorder's (they
    counted that adjoint: 4 bytes, one collective more)."""
    net, x = _MeanLoss(), torch.randn(4, 8)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        parallel(world.rows(x))
        with CommRecorder() as rec:
            parallel(world.rows(x))
    plan = parallel.parallel_plan
    assert plan is not None
    text = format_plan_execute(plan, 0)
    ran = [(r.kind, r.bytes_sent) for r in rec.select(phase="backward") if not r.label]
    assert ran == [] and _backward_listed(text) == ran, rec.summary()
    assert "at mean/ReduceMean group [0, 1] fusion 0 send_bytes 4 (none when" in text
    assert "# bytes this rank sends in one backward (those marked none left out): 0" in text
    traffic = step_traffic(plan, 0, parallel.optimizer_plan)
    assert traffic.total == rec.total_bytes(), rec.summary()
    assert sum(traffic.count.values()) == len(rec.records), rec.summary()
    assert step_cost(plan, CostModel()).collectives == len(rec.records), rec.summary()


class _FrozenFirst(torch.nn.Module):
    """A MatMul ((2, 4), (4, 1)) of the input and `w1` (its partial sums all-reduced over 4
    ranks), ReLU, then a MatMul with `w2`; `w1` frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(8, 16))
        self.matmul = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.matmul2(torch.relu(self.matmul(x, self.w1)), self.w2)
        return out


def _backward_listed(text: str) -> list[tuple[str, int]]:
    """(kind, send_bytes) of each collective the backward section of `text` says runs."""
    section = text.partition("# backward")[2].partition("\n# bytes")[0]
    return [
        (x.split()[0], int(x.split("send_bytes ")[1].split()[0]))
        for x in section.splitlines()[1:]
        if "(none when" not in x
    ]


def test_a_frozen_first_layer_runs_no_backward_collectives() -> None:
    """The first MatMul's inputs (the network input, a frozen weight) need no gradient, so its
    forward AllReduce has no adjoint in backward: execute.ir's backward section, the step's
    traffic and the memory estimate's gradients count only what runs (the recorder's), and the
    plan says `w1` is frozen. Unfrozen after the first call, the AllReduce runs, and the plan
    says so too."""
    net = _FrozenFirst()
    with simulated_world(8) as world:
        world.replicate(net)
        opt = torch.optim.SGD([net.w2], lr=0.1)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step)
        x = world.rank_map(lambda r: torch.randn(4, 16))
        for frozen in (True, False):
            net.w1.requires_grad_(not frozen)
            parallel(x)
            with CommRecorder() as rec:
                parallel(x)
            plan = parallel.parallel_plan
            assert plan is not None
            ran = [
                (r.kind, r.bytes_sent) for r in rec.select(phase="backward") if not r.label
            ]  # (the gradient buckets' are labelled: their own section)
            assert _backward_listed(format_plan_execute(plan, 0)) == ran, rec.summary()
            assert len(ran) == (0 if frozen else 1)
            assert step_traffic(plan, 0, parallel.optimizer_plan).total == rec.total_bytes()
            # (the peak, at the start of backward: the largest value that gets a gradient's)
            grads = {t.name for t in memory_tensors(plan) if t.kind == "gradients"}
            assert grads == {f"gradient of {'matmul2' if frozen else 'matmul'}/MatMul output 0"}
            assert plan.frozen == (("w1",) if frozen else ())
            assert ("param w1: (g1, None) float32[16, 8] (frozen: no gradient)" in str(plan)) is (
                frozen
            )
