"""While an optimizer steps (no closure) inside a wrapped train step, the data-parallel torch-op
mode lets the update's ops through unexamined; a step with a closure (which re-runs the network)
is examined as usual, so its loss is still the global one. 2 simulated ranks, plain data
parallel, results equal single-device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.parallel import AutoParallel, _torchops
from shardwise.testing import simulated_world


class Recording(torch.optim.SGD):
    """SGD that records the active modes' `stepping` counters when it updates."""

    seen: list[list[int]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        self.seen.append([m.stepping for m in _torchops._ACTIVE])
        return super().step(closure)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3)


def single_device(closure: bool) -> tuple[float, torch.Tensor]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch()

    def loss_of() -> torch.Tensor:
        loss: torch.Tensor = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    loss = opt.step(loss_of) if closure else (loss_of(), opt.step())[0]
    return float(loss.detach()), net.weight.detach().clone()


@pytest.mark.parametrize("closure", [False, True], ids=["plain-step", "closure"])
def test_step_ops_pass_unexamined_and_closures_are_examined(closure: bool) -> None:
    want_loss, want_weight = single_device(closure)
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = Recording(net.parameters(), lr=0.1)
        opt.seen = []
        closure_losses: list[torch.Tensor] = []

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            def loss_of() -> torch.Tensor:
                loss: torch.Tensor = nn.functional.cross_entropy(net(x), y)
                loss.backward()
                closure_losses.append(loss.detach())
                return loss

            if closure:
                opt.step(loss_of)
                return closure_losses[-1]
            loss = loss_of()
            opt.step()
            return loss

        loss = AutoParallel(train_step, parallel_mode="semi_auto")(world.same(x), world.same(y))
        got_weight = world.local(net.weight.detach(), 0)
        got_loss = float(world.local(loss, 0))
    # the global step hooks run before the optimizer's body: one active mode, counting
    assert opt.seen == ([[0]] if closure else [[1]])
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_weight, want_weight, rtol=1e-6, atol=1e-7)
