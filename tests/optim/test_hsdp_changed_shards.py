"""Optimizer parallel (levels 1-3) with weights changed in place without a ``torch.optim``
step: scaled between calls (``p.mul_`` under ``no_grad``), rolled back with
``load_state_dict``, updated by a hand-written SGD inside the step. The next forward computes
with the changed weights (levels 1-2 kept the gathered weights past the step and used to
compute with the old ones). 2 simulated ranks; every loss equals one device's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.parallel import AutoParallel, UnsupportedParallelError
from shardwise.testing import simulated_world


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def step_of(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor, how: str) -> torch.Tensor:
        if how == "eval":
            with torch.no_grad():
                return nn.functional.cross_entropy(net(x), y)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if how == "optimizer":
            opt.step()
            opt.zero_grad()
        else:  # a hand-written update
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
                    p.grad = None
        return loss

    return step


def scenario(net: nn.Module, call: Callable[[str], torch.Tensor]) -> list[torch.Tensor]:
    """The calls and the changes between them; each call's loss."""
    losses = [call("optimizer"), call("eval")]
    snapshot = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(0.5)
    losses += [call("eval"), call("optimizer"), call("eval")]
    net.load_state_dict(snapshot)
    losses += [call("eval"), call("hand"), call("eval"), call("hand"), call("eval")]
    return losses


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_weights_changed_in_place_are_used_by_the_next_forward(level: str) -> None:
    x, y = batch()
    net = make_net()
    one = step_of(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    want = [float(v) for v in scenario(net, lambda how: one(x, y, how).detach())]
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        run: Any = AutoParallel(
            step_of(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)),
            parallel_mode="semi_auto",
        ).hsdp(shard_size=-1, threshold=0, optimizer_level=level)
        got = scenario(net, lambda how: run(world.rows(x), world.rows(y), how).detach())
        got_losses = [float(world.local(v, r)) for v in got for r in range(2)]
    torch.testing.assert_close(got_losses, [v for v in want for _ in range(2)], rtol=1e-6, atol=0)


def test_a_weight_changed_in_place_inside_the_step_is_refused() -> None:
    """In the step's plan (before its forward) the change would reach the gathered copy only;
    the error names the op, the parameter and the fix (change the weights between calls)."""
    x, y = batch()
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)

        def evaluate_halved(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                for p in net.parameters():
                    p.mul_(0.5)
                return nn.functional.cross_entropy(net(x), y)

        run = AutoParallel(evaluate_halved, parallel_mode="semi_auto")
        run.hsdp(shard_size=-1, threshold=0, optimizer_level="level2")
        with pytest.raises(
            UnsupportedParallelError, match=r"mul_ at .* changes parameter 0.weight"
        ):
            run(world.rows(x), world.rows(y))
