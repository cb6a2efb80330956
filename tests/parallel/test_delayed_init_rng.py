"""Delayed init on simulated ranks leaves the random stream where eager construction does.

A network built inside ``sw.no_init_parameters()`` gets its weights at AutoParallel's first
call, each rank replaying the construction from its own random stream. Afterwards every rank's
generator must stand where eager construction leaves it (as each process's does in a real job),
so that what draws next (dropout in the step, ``torch.rand`` after it) draws what one device
draws: a dropout network trained data parallel on 2 simulated ranks (with and without hsdp)
gives the single-device losses, its exact collectives, and the single-device draw after the
steps; a network without dropout leaves ``torch.rand`` at eager's draw after the first call.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication.recorder import CommRecorder
from shardwise.testing import assert_matches_single_device, simulated_world

SEED, WORLD, STEPS = 1, 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(F.relu(self.l1(x))))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
        for _ in range(STEPS)
    ]


def single_device() -> tuple[list[torch.Tensor], torch.Tensor]:
    """The losses of the eagerly built network and a draw after its steps."""
    torch.manual_seed(SEED)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, torch.rand(3)


@pytest.mark.parametrize("hsdp", [False, True], ids=["dp", "hsdp"])
def test_dropout_after_delayed_init_matches_single_device(hsdp: bool) -> None:
    want_losses, want_draw = single_device()
    data = batches()
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with simulated_world(WORLD) as world:
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        if hsdp:
            parallel.hsdp(threshold=0)
        for i, (x, y) in enumerate(data):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want_losses[i], what=f"loss {i}")
            loss_sum = ("AllReduce", "forward", (0, 1))
            if hsdp:  # (the parameters gathered in one bucket, the gradients scattered in one)
                want = {("AllGather", "forward", (0, 1)): 1, ("ReduceScatter", "step", (0, 1)): 1}
            else:  # (the gradients summed in one bucket)
                want = {("AllReduce", "backward", (0, 1)): 1}
            assert rec.kinds() == Counter({**want, loss_sum: 1}), rec.summary()
        assert_matches_single_device(torch.rand(3), want_draw, what="draw after the steps")


def test_rand_after_materialization_is_eager_construction_draw() -> None:
    torch.manual_seed(SEED)
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    want = torch.rand(3)  # (the generator after eager construction)
    x = batches()[0][0]
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with simulated_world(WORLD) as world:
        parallel = sw.AutoParallel(lambda a: net(a).sum(), parallel_mode="semi_auto")
        parallel(world.rows(x))
        assert_matches_single_device(torch.rand(3), want, what="draw after the first call")
