"""A row-parallel layer's partial sum, cut to rows by its consumer, runs as one ReduceScatter.

A Megatron MLP on 4 simulated ranks (dp 2 x mp 2) with a residual add: ``c_proj`` leaves a
partial sum over mp and the add takes its rows cut over dp x mp (data parallel). The plan marks
that edge (`EdgePlan.scatter`, printed ``ReduceScatter(sum) over g1 on dim 0``) and keeps the
mark through its JSON; the step sends a ReduceScatter forward (half an AllReduce's bytes) and an
AllGather backward, and its loss and every gradient equal one device's. The reports count what
was sent. An edge the plan needs all-reduced whole (the loss's weighted mean) keeps its
AllReduce, and a plan file written before the mark existed loads without it.
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
