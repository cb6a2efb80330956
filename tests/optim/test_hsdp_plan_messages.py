"""What the optimizer-parallel plan and its settings tell the user.

A 0-d parameter (a learned scale) cannot be sharded: it has no dim 0. Its plan reason read
``dim 0 (0) not divisible by 2`` (0 divides by 2); it now says it is 0-d. An unknown
``comm_fusion`` key is refused with the valid keys, ``openstate`` among them (it was left out,
though accepted and documented).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


X = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))


def test_a_0d_parameter_is_not_sharded_because_it_is_0d() -> None:
    net = Scaled()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto").hsdp(threshold=0)
        parallel(world.rows(X)).pow(2).mean().backward()
        plan = parallel.optimizer_plan
    assert plan is not None
    assert plan.param("scale").reason == "0-d (no dim 0 to shard)"
    assert plan.param("lin.weight").sharded
    assert "not divisible" not in str(plan)


def test_an_unknown_comm_fusion_key_lists_every_valid_key() -> None:
    parallel = sw.AutoParallel(Scaled(), parallel_mode="semi_auto").hsdp(threshold=0)
    valid = r"unknown key 'allreduse'; valid keys: 'allreduce', 'allgather', 'reducescatter', "
    with pytest.raises(ValueError, match=valid + "'openstate'"):
        parallel.comm_fusion({"allreduse": {"mode": "size", "config": 1}})
    parallel.comm_fusion({"openstate": False})  # (accepted)
