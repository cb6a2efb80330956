"""ReduceMax, Exp, Log and Cast under `AutoParallel` (semi_auto) on 4 and 8 simulated ranks
against one device.

The network is a log-softmax written with primitives, the class dim split over half the ranks:
``h = x @ w``, ``m = ReduceMax(h)`` (AllReduce(max) over the class axis), ``z = h - m``,
``ls = Log(ReduceSum(Exp(z)))`` (AllReduce(sum)), ``out = z - ls + m`` (m kept so that its
gradient matters), then ``Cast`` to float64 with the data-parallel default. Loss: NLL over the
global batch. The loss and every gradient equal one device's (1e-5 relative), and the
collectives are exactly: the input rows gathered over the class axis, ReduceMax's AllReduce(max)
and ReduceSum's AllReduce(sum) (each with its adjoint, an AllReduce(sum) in backward), an
AlltoAll to Cast's data-parallel rows (and its adjoint), the loss's AllReduce, and one gradient
AllReduce of w over the batch axis.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, FEATURES, CLASSES = 16, 12, 16


class LogSoftmaxNet(nn.Module):
    """x [16, 12] -> MatMul [16, 16] -> the log-softmax above -> Cast(float64)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        c = world // 2  # the class dim's split
        self.w = nn.Parameter(
            torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(31))
        )
        self.mm = sw.ops.MatMul().shard(((2, 1), (1, c)))
        self.max = sw.ops.ReduceMax(keep_dims=True).shard(((2, c),))
        self.sub = sw.ops.Sub().shard(((2, c), (2, 1)))
        self.exp = sw.ops.Exp().shard(((2, c),))
        self.sum = sw.ops.ReduceSum(keep_dims=True).shard(((2, c),))
        self.log = sw.ops.Log().shard(((2, 1),))
        self.sub2 = sw.ops.Sub().shard(((2, c), (2, 1)))
        self.add = sw.ops.Add().shard(((2, c), (2, 1)))
        self.cast = sw.ops.Cast()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mm(x, self.w)
        m = self.max(h, -1)
        z = self.sub(h, m)
        ls = self.log(self.sum(self.exp(z), -1))
        out: torch.Tensor = self.cast(self.add(self.sub2(z, ls), m), torch.float64)
        return out


@pytest.mark.parametrize("world", [4, 8])
def test_reduce_max_exp_log_cast(world: int) -> None:
    g = torch.Generator().manual_seed(32)
    x, y = (
        torch.randn(BATCH, FEATURES, generator=g),
        torch.randint(0, CLASSES, (BATCH,), generator=g),
    )
    single = LogSoftmaxNet(world)
    out = single(x)
    assert out.dtype == torch.float64
    loss = F.nll_loss(out, y)
    loss.backward()
    assert single.w.grad is not None
    want = single.w.grad.clone()

    net = LogSoftmaxNet(world)
    every, half = tuple(range(world)), world // 2
    classes, batch = tuple(range(half)), (0, half)  # matrix [2, 1, W/2]: g0 = rows, g1 = classes
    with simulated_world(world) as w:
        w.replicate(net)
        parallel = AutoParallel(net, parallel_mode="semi_auto")
        with CommRecorder() as rec:
            got = sw.ops.AllReduce()(F.nll_loss(parallel(w.rows(x)), w.rows(y))) / world
            got.backward()
        assert_matches_single_device(got, loss.detach(), what="loss")
        assert rec.kinds() == Counter(
            {
                ("AllGather", "forward", classes): 1,  # input rows -> mm x (rows over g0)
                ("AllReduce", "forward", classes): 2,  # ReduceMax (max), ReduceSum (sum)
                ("AllReduce", "backward", classes): 2,  # their adjoints
                ("AllReduce", "forward", every): 1,  # the loss
                ("AllReduce", "backward", every): 1,  # (its adjoint)
                ("AllReduce", "backward", batch): 1,  # w's gradient over the rows axis
                ("AlltoAll", "forward", classes): 1,  # (rows, classes) -> Cast's rows
                ("AlltoAll", "backward", classes): 1,  # (its adjoint)
            }
        ), rec.summary()
        plan = parallel.parallel_plan
        assert plan is not None
        comms = [str(c) for n in plan.nodes for c in n.comms]
        assert any(c.startswith("AllReduce(max)") for c in comms), comms
        layout, _ = plan.param_layouts()["w"]
        assert net.w.grad is not None
        assert_matches_single_device(
            net.w.grad, lambda r: want[layout.local_slice(r, want.shape)], what="w.grad"
        )
