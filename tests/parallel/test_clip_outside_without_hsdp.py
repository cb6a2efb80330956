"""torch's gradient clipping outside the wrapped call without hsdp, parameters split.

A Megatron-style MLP on 2 x 2 simulated ranks (``l1`` column-parallel, ``l2`` row-parallel:
each rank holds blocks of their weights), ``loss.backward()`` in the user's loop (the module
form, or the train-step form with the clipping around the wrapped step), then
``torch.nn.utils.clip_grad_norm_(net.parameters(), ...)`` as one device writes it: it clipped
each rank by the norm of its own blocks (ranks 0.227 / 0.215 where one device has 0.2685),
silently. Now it takes the norm of the whole gradients, as with hsdp and inside a wrapped call:
one device's norm on every rank and one device's clipped gradients (this rank's blocks), with
one AllReduce of the split gradients' partial norms over the model-parallel group;
``torch.nn.utils.get_total_norm`` of the parameters' gradients gives the same norm.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from .test_zoo_megatron import block_of

MAX_NORM = 0.1


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(F.relu(self.l2(F.gelu(self.l1(x))))), y)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)


DATA = _data()  # (made outside the simulated worlds)


def megatron() -> MLP:
    net = MLP()
    sw.shard(net.l1, in_strategy=((2, 1), (2, 1)))  # (weight rows over mp)
    sw.shard(net.l2, in_strategy=((2, 2), (1, 2)))  # (weight columns over mp)
    return net


@pytest.mark.parametrize("form", ["module", "step"])
def test_torch_clipping_outside_the_call_matches_one_device(form: str) -> None:
    x, y = DATA
    ref = MLP()
    ref(x, y).backward()
    want_total = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert want > 2 * MAX_NORM  # (it clips)
    net = megatron()
    with simulated_world(4) as world:
        world.replicate(net)
        if form == "module":
            parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
            parallel(world.rows(x), world.rows(y)).backward()
        else:

            def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                loss: torch.Tensor = net(a, b)
                loss.backward()
                return loss

            parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
            parallel(world.rows(x), world.rows(y))
        with CommRecorder() as rec:
            total = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
        assert_matches_single_device(total, want_total, what="get_total_norm")
        assert rec.kinds() == Counter({("AllReduce", "forward", (0, 1)): 1}), rec.summary()
        with CommRecorder() as rec:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        assert_matches_single_device(norm, want, what="the norm")
        assert rec.kinds() == Counter({("AllReduce", "forward", (0, 1)): 1}), rec.summary()
        for name, p in net.named_parameters():
            full = ref.get_parameter(name).grad
            assert full is not None
            assert_matches_single_device(p.grad, block_of(parallel, name, full), what=name)


def test_whole_gradients_are_left_to_torch() -> None:
    """Plain data parallel (every parameter replicated, its gradient reduced in backward):
    torch's own clipping, no collective (norm_type 0 too, which split gradients refuse)."""
    x, y = DATA
    ref = MLP()
    ref(x, y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=0)
    net = MLP()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        parallel(world.rows(x), world.rows(y)).backward()
        with CommRecorder() as rec:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM, norm_type=0)
        assert_matches_single_device(norm, want, what="the norm")
        assert rec.count() == 0, rec.summary()
