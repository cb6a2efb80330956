"""Optimizer parallel and a forward outside the plan: a GAN step that runs ``D(fake)`` after
``d_loss.backward()`` (no pass of the plan starts there, so D's weights are this rank's
shards) fails with torch's shape error and a note naming the op, the parameter and the fix, at
every level (torch's error alone said nothing of shards); without ``hsdp()`` the same step
matches one device. A parameter the plan stores as an operator-level block gets the
same note, naming its layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world


class MatmulD(nn.Module):
    """A discriminator written with ``@`` (a dunder op) instead of ``nn.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.v = nn.Parameter(torch.randn(1, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w.t()) @ self.v.t()


class Gan(nn.Module):
    def __init__(self, matmul: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.d: nn.Module = (
            MatmulD() if matmul else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        )


def gan_step(net: Gan, opt: torch.optim.Optimizer) -> Any:
    def step(real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fake = net.g(z)
        d_loss = net.d(real).pow(2).mean()
        d_loss.backward()
        g_loss = net.d(fake).pow(2).mean()  # (after a backward: outside the plan)
        g_loss.backward()
        opt.step()
        opt.zero_grad()
        return g_loss

    return step


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


@pytest.mark.parametrize(
    ("level", "matmul"), [("level1", False), ("level2", False), ("level3", False), ("level1", True)]
)
def test_a_forward_after_backward_reading_shards_names_the_fix(level: str, matmul: bool) -> None:
    real, z = _data()
    net = Gan(matmul)
    with simulated_world(4) as world:
        world.replicate(net)
        step = gan_step(net, torch.optim.SGD(net.parameters(), lr=0.05))
        wrapper = sw.AutoParallel(step, parallel_mode="semi_auto").hsdp(
            optimizer_level=level, threshold=0
        )
        with pytest.raises(RuntimeError) as err:
            wrapper(world.rows(real), world.rows(z))
    msg = "\n".join(err.value.__notes__)
    op = "torch.Tensor.matmul" if matmul else "torch.nn.functional.linear"
    assert f"{op} reads d." in msg
    assert "after loss.backward(), outside the plan" in msg
    assert "run every forward before the first backward" in msg


def test_without_hsdp_the_gan_step_matches_one_device() -> None:
    real, z = _data()
    single, net = Gan(), Gan()
    want_step = gan_step(single, torch.optim.SGD(single.parameters(), lr=0.05))
    for _ in range(2):
        want_step(real, z)
    with simulated_world(4) as world:
        world.replicate(net)
        step = gan_step(net, torch.optim.SGD(net.parameters(), lr=0.05))
        wrapper = sw.AutoParallel(step, parallel_mode="semi_auto")
        for _ in range(2):
            wrapper(world.rows(real), world.rows(z))
        want = dict(single.named_parameters())
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), want[name].detach(), what=name)


def test_an_operator_level_block_read_outside_the_plan_names_it() -> None:
    """Without ``hsdp()``, D's last layer row-parallel (``sw.shard``; as sharding propagation
    may choose on its own): ``D(fake)`` after the backward reads its block and fails; the note
    names the parameter, its stored layout and the fix (torch's error came alone)."""
    real, z = _data()
    net = Gan()
    d = net.d
    assert isinstance(d, nn.Sequential)
    sw.shard(d[2], in_strategy=((1, 4), (1, 4)))
    with simulated_world(4) as world:
        world.replicate(net)
        step = gan_step(net, torch.optim.SGD(net.parameters(), lr=0.05))
        with pytest.raises(RuntimeError) as err:
            sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(real), world.rows(z))
    msg = "\n".join(err.value.__notes__)
    assert "torch.nn.functional.linear reads d.2.weight after loss.backward()" in msg
    assert "the plan stores it split over the ranks ((None, g0) on DeviceMatrix" in msg
    assert "run every forward before the first backward" in msg
