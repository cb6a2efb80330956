"""Plans the picture tests draw (`test_plan_pictures`, `test_plan_browser`).

- `seed003_plan`: seed 003's network (int strategies, or its Layout version) on 8 devices,
  global batch 32 (the plan `AutoParallel.plan` makes).
- `wide_plan`: a MatMul ``((32, 32), (32, 1))``, ReLU, MatMul on 1,024 devices: a (32, 32)
  matrix, planned on meta tensors.
- `deep_plan`: 500 Linear + ReLU layers (1,000 ops) on 8 devices.
"""

from __future__ import annotations

import torch
from tests.parallel.test_seed003_parity import Network
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan, capture, plan_semi_auto
from shardwise.testing import simulated_world


def seed003_plan(layouts: bool = False) -> ParallelPlan:
    net = Network(layouts)
    with simulated_world(8) as world:
        world.replicate(net)
        return AutoParallel(net).plan(shapes=[(32, 1, 28, 28)])


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(256, 512))
        self.w2 = nn.Parameter(torch.empty(512, 64))
        self.mm1 = sw.ops.MatMul().shard(((32, 32), (32, 1)))
        self.relu = sw.ops.ReLU()
        self.mm2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mm2(self.relu(self.mm1(x, self.w1)), self.w2)
        return out


def wide_plan() -> ParallelPlan:
    with torch.device("meta"):
        net = _Wide()
    return plan_semi_auto(capture(net, torch.zeros(1024, 256, device="meta")), 1024)


def deep_plan() -> ParallelPlan:
    with torch.device("meta"):
        net = nn.Sequential(*[m for _ in range(500) for m in (nn.Linear(64, 64), nn.ReLU())])
    return plan_semi_auto(capture(net, torch.zeros(64, 64, device="meta")), 8)
