"""A BatchNorm over features a layer split across ranks keeps every rank's running statistics
whole and equal to one device's.

An ``nn.Embedding`` whose embedding dim is split over mp hands a ``BatchNorm1d`` its features
split: the plan gives the op this rank's block of each running statistic (a buffer, stored
whole on every rank). The op updated that block in place, so each rank's buffer held its own
block updated and the rest stale: the ranks' checkpoints differed, and `merge` / `transform`
refused them. The plan now gathers the changed block back into the whole buffer after the op
(an `EdgePlan` with ``written_back``: one AllGather over mp per statistic), so the buffers,
the loss and the gradients equal one device's.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import ParallelPlan
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match

STEPS = 2


class Net(nn.Module):
    def __init__(self, megatron: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.bn, self.head = nn.Embedding(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        if megatron:  # (rows over dp, the embedding dim over mp)
            sw.shard(self.emb, in_strategy=((2,), (1, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.bn(self.emb(x)))
        return out


g = torch.Generator().manual_seed(3)
DATA = [(torch.randint(0, 10, (8,), generator=g), torch.randint(0, 3, (8,), generator=g))] * STEPS


def test_running_statistics_of_split_features_match_one_device() -> None:
    ref = Net(megatron=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in DATA:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        want.append(loss.detach())
        if len(want) < STEPS:
            opt.step()
            opt.zero_grad()
    net = Net()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            if not last:
                opt.step()
                opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            for s, (x, y) in enumerate(DATA):
                got = parallel(world.rows(x), world.rows(y), s == STEPS - 1)
                assert_matches_single_device(got, want[s], what=f"loss {s}")
        assert_grad_blocks_match(parallel, net, ref)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            whole = getattr(ref.bn, name)
            assert_matches_single_device(getattr(net.bn, name), whole, what=name)
        plan = parallel.parallel_plan
        assert plan is not None
    backs = [e for e in plan.edges if e.written_back]
    assert [(e.value, str(e.src), str(e.dst)) for e in backs] == [
        ("buffer:bn.running_mean", "(g1)", "(None)"),
        ("buffer:bn.running_var", "(g1)", "(None)"),
    ]
    assert "buffer:bn.running_mean (g1) -> (None) after the op: AllGather" in str(plan)
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    # (rank 0's groups, per step) over mp: the ids gathered for the embedding and the two
    # statistics gathered back; over dp: the rows gathered for the batch norm; the head's rows
    # split again (AlltoAll); the loss; the gradient buckets (and the gather's adjoint)
    per_step = {
        ("AllGather", "forward", (0, 1)): 3,
        ("AllGather", "forward", (0, 2)): 1,
        ("AlltoAll", "forward", (0, 1)): 1,
        ("AllReduce", "forward", (0, 1, 2, 3)): 1,
        ("AlltoAll", "backward", (0, 1)): 1,
        ("ReduceScatter", "backward", (0, 2)): 1,
        ("AllReduce", "backward", (0, 1, 2, 3)): 1,
        ("AllReduce", "backward", (0, 2)): 1,
    }
    assert rec.kinds() == Counter({k: STEPS * n for k, n in per_step.items()}), rec.summary()
