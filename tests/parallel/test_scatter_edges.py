"""A row-parallel layer's partial sum, cut to rows by its consumer, runs as one ReduceScatter.

A Megatron MLP on 4 simulated ranks (dp 2 x mp 2) with a residual add: ``c_proj`` leaves a
partial sum over mp and the add takes its rows cut over dp x mp (data parallel). The plan marks
that edge (`EdgePlan.scatter`, printed ``ReduceScatter(sum) over g1 on dim 0``) and keeps the
mark through its JSON; the step sends a ReduceScatter forward (half an AllReduce's bytes) and an
AllGather backward, and its loss and every gradient equal one device's. The reports count what
was sent. An edge the plan needs all-reduced whole (the loss's weighted mean) keeps its
AllReduce, and a plan file written before the mark existed loads without it.

On 8 ranks (dp x sp x mp) a contraction split over the tuple ("sp", "mp") leaves a partial sum
over both axes; cut over both it is one ReduceScatter over their combined group (its adjoint one
AllGather), its ranks ordered as the cut orders the blocks (first axis outer, also when that is
not rank order); the column-parallel input, its rows gathered over both axes, one AllGather.
"""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise.communication.recorder import bytes_bound
from shardwise.planner import ParallelPlan
from shardwise.report._summary import step_traffic
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, D = 8, 8


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.c_proj(torch.tanh(self.c_fc(x)))
        return out


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).pow(2).mean()


def test_a_partial_sum_cut_to_rows_is_one_reduce_scatter() -> None:
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1))
    ref = Residual()
    want = loss_of(ref, x)
    want.backward()
    net = Residual()
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net.c_fc, in_strategy=((2, 1), (2, 1)))  # column parallel over mp
        sw.shard(net.c_proj, in_strategy=((2, 2), (1, 2)))  # row parallel: a partial sum

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net, a)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            loss = parallel(world.rows(x))
        assert_matches_single_device(loss, want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            full = ref.get_parameter(name).grad
            assert full is not None and p.grad is not None
            layout = plan.params[name].layout
            assert_matches_single_device(
                p.grad, lambda r, f=full, t=layout: f[t.local_index(r, tuple(f.shape))], what=name
            )
    fused = [e for e in plan.edges if e.scatter]
    assert [str(e).split(": ", 1)[1] for e in fused] == ["ReduceScatter(sum) over g1 on dim 0"]
    assert [c.kind for c in fused[0].collectives("add")] == ["ReduceScatter"]
    weighted = [e for e in plan.edges if e.reduced and not e.scatter]
    assert weighted and all(not e.steps for e in weighted)  # (the loss: AllReduce whole)
    block = 2 * BATCH // 4 * D * 4  # (c_proj's output rows over dp: [4, 8] float32)
    scatters = rec.select("ReduceScatter", "forward")
    assert [r.bytes_sent for r in scatters] == [bytes_bound("ReduceScatter", block, 2)]
    assert [r.kind for r in rec.select(phase="backward") if r.group == (0, 1)] == ["AllGather"]
    assert step_traffic(plan, 0, None).total == rec.total_bytes(), rec.summary()
    again = ParallelPlan.from_dict(plan.to_dict())
    assert again == plan and [e.scatter for e in again.edges] == [e.scatter for e in plan.edges]
    old = plan.to_dict()
    for e in old["edges"]:
        e.pop("scatter", None)  # (a file written before the mark: loads without it)
    assert not any(e.scatter for e in ParallelPlan.from_dict(old).edges)


TUPLE_LAYOUT = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))


class TupleMLP(nn.Module):
    """Column- then row-parallel Linear whose model dim is split over a tuple of axes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c_fc = nn.Linear(16, 32, bias=False)
        self.c_proj = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor, rows: object) -> torch.Tensor:
        h = self.c_proj(torch.relu(self.c_fc(x)))
        out: torch.Tensor = (h if rows is None else sw.reshard(h, rows)) + x
        return out


def _tuple_run(model: tuple[str, str], rows: object) -> tuple[ParallelPlan, CommRecorder]:
    """TupleMLP on 8 simulated ranks with its model dim over `model`; the residual's rows as
    `rows` (None: as the residual's) at c_proj's output; loss and gradients checked against one
    device."""
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    ref = TupleMLP()
    want = nn.functional.mse_loss(ref(x, None), y)
    want.backward()
    net = TupleMLP()
    lay = TUPLE_LAYOUT
    sw.shard(net.c_fc, in_strategy=(lay("dp", "None"), lay(model, "None")))
    sw.shard(net.c_proj, in_strategy=(lay("dp", model), lay("None", model)))
    with simulated_world(8) as world:
        world.replicate(net)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(net(a, rows), b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            full = ref.get_parameter(name).grad
            assert full is not None and p.grad is not None
            layout = plan.params[name].layout
            assert_matches_single_device(
                p.grad, lambda r, f=full, t=layout: f[t.local_index(r, tuple(f.shape))], what=name
            )
    return plan, rec


def test_a_partial_sum_over_a_tuple_of_axes_cut_over_them_is_one_reduce_scatter() -> None:
    # (c_proj's contraction over ("sp", "mp"): its partial sum over both, cut to the residual's
    # rows over dp x sp x mp: one ReduceScatter over sp x mp, MindSpore's one collective for a
    # tuple dim, not a ReduceScatter over sp, an AllReduce over mp and a Slice)
    plan, rec = _tuple_run(("sp", "mp"), None)
    fused = [e for e in plan.edges if e.scatter]
    assert [str(e).split(": ", 1)[1] for e in fused] == [
        "ReduceScatter(sum) over (g1, g2) on dim 0"
    ]
    assert [(c.kind, c.axes) for c in fused[0].collectives("add")] == [
        ("ReduceScatter", ("g1", "g2"))
    ]
    forward = [(r.kind, r.group) for r in rec.select(phase="forward") if r.kind != "AllGather"]
    assert forward.count(("ReduceScatter", (0, 1, 2, 3))) == 1
    assert [k for k, g in forward if g != tuple(range(8))] == ["ReduceScatter"]  # (no AllReduce)
    block = 16 // 2 * 16 * 4  # (c_proj's output rows over dp: [8, 16] float32)
    sent = [r.bytes_sent for r in rec.select("ReduceScatter", "forward")]
    assert sent == [bytes_bound("ReduceScatter", block, 4)]
    # (c_fc's input, rows over dp x sp x mp, gathered to rows over dp: one AllGather over
    # sp x mp, not one over mp and one over sp)
    assert [r.group for r in rec.select("AllGather", "forward")] == [(0, 1, 2, 3)]
    gathered = [str(e).split(": ", 1)[1] for e in plan.edges if e.value == "input:args[0]"]
    assert gathered == ["AllGather(dim=0, axis=(g1, g2), group size 4)"]
    backward = [(r.kind, r.group) for r in rec.select(phase="backward")]
    assert backward.count(("AllGather", (0, 1, 2, 3))) == 1
    assert [g for k, g in backward if k == "AllReduce"] == [(0, 4)]  # (the gradients over dp)
    assert step_traffic(plan, 0, None).total == rec.total_bytes(), rec.summary()


def test_a_tuple_reduce_scatter_hands_out_blocks_in_the_tuples_order() -> None:
    # (c_proj's output resharded to rows over ("dp", "mp", "sp"): the ReduceScatter's group over
    # mp x sp is ordered mp outer, ranks 0, 2, 1, 3, not in rank order)
    plan, rec = _tuple_run(("sp", "mp"), TUPLE_LAYOUT(("dp", "mp", "sp"), "None"))
    fused = [e for e in plan.edges if e.scatter]
    assert [str(e).split(": ", 1)[1] for e in fused] == [
        "ReduceScatter(sum) over (g2, g1) on dim 0"
    ]
    assert [r.group for r in rec.select("ReduceScatter", "forward")] == [(0, 1, 2, 3)]
    assert step_traffic(plan, 0, None).total == rec.total_bytes(), rec.summary()
