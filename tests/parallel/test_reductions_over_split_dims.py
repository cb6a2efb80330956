"""Torch reductions across the split batch dim whose partial results do not add up: a max, a
min, a norm, a product (``x.amax(0)``, ``x.max()``, ``x.norm(dim=0)``, ``x.prod(0)``,
``F.normalize(x, dim=0)``) under semi_auto and sharding_propagation on 4 simulated ranks.

DTensor's rules leave such a reduction of a split dim partial by max / min / norm / product;
the plan reduces partial values by sum or mean only (they were summed: a wrong loss, no error).
The rows are now gathered before such an op (`aten_rules.odd_partial_axes`): loss and every
gradient equal one device's, and the collectives are exactly the rows' AllGather (its adjoint a
ReduceScatter), the loss's AllReduce and the weight's gradient AllReduce.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

WORLD, BATCH, H = 4, 16, 8

REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "amax": lambda y: y.amax(0),
    "amin": lambda y: y.amin(0),
    "max": lambda y: y.max(),
    "norm": lambda y: y.norm(dim=0),
    "prod": lambda y: (y * 0.1 + 1).prod(0),
    "normalize": lambda y: F.normalize(y, dim=0),
}


class Net(nn.Module):
    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.reduce = reduce
        self.w = nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        return (y + self.reduce(y)).pow(2).mean()


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_reduction_that_does_not_add_up_gathers_its_rows(name: str, mode: str) -> None:
    x = torch.randn(BATCH, H, generator=torch.Generator().manual_seed(4))
    single = Net(REDUCTIONS[name])
    want = single(x)
    want.backward()
    net = Net(REDUCTIONS[name])
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a)
            loss.backward()
            return loss

        with CommRecorder() as rec:
            got = sw.AutoParallel(step, parallel_mode=mode)(world.rows(x))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_matches_single_device(net.w.grad, single.w.grad, what="w.grad")
    every = tuple(range(WORLD))
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", every): 1,  # the rows, before the reduction
            ("ReduceScatter", "backward", every): 1,  # (its adjoint)
            ("AllReduce", "forward", every): 1,  # the loss
            ("AllReduce", "backward", every): 1,  # w's gradient
        }
    ), rec.summary()
