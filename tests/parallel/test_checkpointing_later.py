"""Activation checkpointing turned on after a train step was planned.

The capture refuses checkpointing (`tests/planner/test_capture.py`); a network that turns it on
later (``model.gradient_checkpointing_enable()`` after the first step) runs the same ops, so
the plan would run on, but its recomputation in backward runs on this rank's blocks, outside
the plan: a dropout there draws its own mask where the plan takes this rank's block of one
global mask (other gradients, silently), and a collective of the plan does not run. So the first
checkpointed op is refused at the next call, naming it (reentrant or not; with or without a
dropout that draws).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import simulated_world


class Net(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.p, self.how = dropout, ""  # (`how`: "", "reentrant" or "non-reentrant")

    def region(self, h: torch.Tensor) -> torch.Tensor:
        return self.c(F.dropout(torch.tanh(h), self.p, self.training))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how:
            h = checkpoint(self.region, h, use_reentrant=self.how == "reentrant")
        else:
            h = self.region(h)
        out: torch.Tensor = self.b(h)
        return out


def make(dropout: float) -> Net:
    torch.manual_seed(0)
    return Net(dropout)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("dropout", [0.5, 0.0])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_ops_checkpointed_after_planning_are_refused(how: str, dropout: float) -> None:
    net, (x, y) = make(dropout), batch()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        parallel(world.rows(x), world.rows(y))
        net.how = how
        with pytest.raises(UnsupportedParallelError, match=r"%1 tanh.*activation checkpointing"):
            parallel(world.rows(x), world.rows(y))
