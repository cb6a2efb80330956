"""Add / Sub / Mul / Div with a Python number operand (docs/ops.md: scalars allowed) under
`AutoParallel`: the number is a 0-d input (strategy entry ``()``, added when the strategy gives
the tensor's entry only), on either side; output and gradient equal one device's. 4 simulated
ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import assert_matches_single_device, simulated_world

LAYOUT = sw.Layout((4,), ("dp",))
STRATEGIES = [None, ((4, 1),), ((4, 1), ()), (LAYOUT("dp", "None"),)]


class Net(nn.Module):
    def __init__(self, op: str, strategy: object, left: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 12))
        self.mul = sw.ops.Mul()
        self.op = getattr(sw.ops, op)()
        if strategy is not None:
            self.op.shard(strategy)
        self.left = left

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mul(x, self.w)
        out: torch.Tensor = self.op(2.5, h) if self.left else self.op(h, 2.5)
        return out


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["default", "one", "two", "layout"])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_a_number_operand_matches_one_device(op: str, strategy: object) -> None:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    for left in (False, True):
        if left and strategy is not None and len(strategy) == 2:  # type: ignore[arg-type]
            continue  # (the explicit pair names the tensor first)
        single = Net(op, None, left)
        want = single(x)
        want.sum().backward()
        net = Net(op, strategy, left)
        with simulated_world(4) as world:
            world.replicate(net)
            out = AutoParallel(net)(world.rows(x))
            sw.ops.AllReduce()(out.sum()).backward()
            rows = want.detach().chunk(4)
            assert_matches_single_device(out.detach(), lambda r, rows=rows: rows[r])
            assert net.w.grad is not None and single.w.grad is not None
            assert_matches_single_device(net.w.grad, single.w.grad, what="w.grad")
