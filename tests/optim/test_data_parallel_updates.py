"""parallel_mode="data_parallel" averages the gradients in the step of the optimizers the wrapper
knows: a train step that changes the weights otherwise (a hand-written update, an optimizer built
inside the step) used each rank's own gradient; it is refused with a ValueError naming the
parameter and the fix. A step that only accumulates gradients, or evaluates, before its first
optimizer step is not. 2 simulated ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise.parallel import AutoParallel
from shardwise.testing import simulated_world


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("how", ["hand-written", "optimizer built in the step"])
def test_weights_changed_without_a_known_optimizer_step_are_refused(how: str) -> None:
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        made: dict[str, torch.optim.Optimizer] = {}

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            if how == "hand-written":
                with torch.no_grad():
                    for p in net.parameters():
                        p.sub_(0.1 * p.grad)  # type: ignore[operator]
            else:
                opt = made.setdefault("opt", torch.optim.SGD(net.parameters(), lr=0.1))
                opt.step()
            return loss

        run = AutoParallel(step, parallel_mode="data_parallel")
        with pytest.raises(ValueError, match=r"changed parameter '0\.weight' without a step") as e:
            run(world.rows(x), world.rows(y))
    assert "Build the optimizer before the wrapper" in str(e.value)


def test_accumulating_and_evaluating_first_then_stepping_match_one_device() -> None:
    x, y = batch()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor, how: str) -> torch.Tensor:
        if how == "eval":
            with torch.no_grad():
                return nn.functional.cross_entropy(net(x), y)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if how == "step":
            opt.step()
            opt.zero_grad()
        return loss

    calls = ["eval", "accumulate", "step", "eval", "step", "eval"]
    want = [float(step(x, y, how).detach()) for how in calls]
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        run: Any = AutoParallel(step, parallel_mode="data_parallel")
        got = [float(world.local(run(world.rows(x), world.rows(y), how), 0)) for how in calls]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
