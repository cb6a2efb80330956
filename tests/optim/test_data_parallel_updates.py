"""parallel_mode="data_parallel" averages the gradients in the step of the optimizers the wrapper
knows (or takes at their first step): a train step that changes the weights otherwise (a
hand-written update) used each rank's own gradient; it is refused with a ValueError naming the
parameter and the fix. A step that only accumulates gradients, or evaluates, before its first
optimizer step is not. 2 simulated ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise.parallel import AutoParallel
from shardwise.testing import assert_matches_single_device, simulated_world


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_weights_changed_without_an_optimizer_step_are_refused() -> None:
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            return loss

        run = AutoParallel(step, parallel_mode="data_parallel")
        with pytest.raises(ValueError, match=r"changed parameter '0\.weight' without a step") as e:
            run(world.rows(x), world.rows(y))
    assert "Build the optimizer before the wrapper" in str(e.value)


def test_an_optimizer_built_in_the_step_is_averaged_once_and_refused_anew() -> None:
    """An optimizer built inside the step is taken at its first step (its gradients averaged:
    the update is one device's); one built anew in the next call, over the same parameters,
    is refused naming the fix."""
    net, (x, y) = make_net(), batch()
    ref = make_net()
    nn.functional.cross_entropy(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            torch.optim.SGD(net.parameters(), lr=0.1).step()
            return loss

        run = AutoParallel(step, parallel_mode="data_parallel")
        run(world.rows(x), world.rows(y))
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
        )
        with pytest.raises(ValueError, match=r"an optimizer built anew in each call\?"):
            run(world.rows(x), world.rows(y))


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


class _Lookahead(torch.optim.Optimizer):
    """A wrapper optimizer (as Lookahead, Accelerate's AcceleratedOptimizer): its step runs
    an inner optimizer over the same parameter groups, then moves slow weights toward them."""

    def __init__(self, inner: torch.optim.Optimizer, alpha: float = 0.5) -> None:
        self.inner, self.alpha = inner, alpha
        self.slow = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        super().__init__(inner.param_groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()
        params = [p for g in self.inner.param_groups for p in g["params"]]
        for p, s in zip(params, self.slow, strict=True):
            s.add_(p - s, alpha=self.alpha)
            p.copy_(s)


def test_a_wrapper_optimizers_inner_step_is_left_alone() -> None:
    """The module form takes the wrapper at its first step; the inner optimizer it steps, over
    the same parameters, is not refused as 'built anew' (the outer step averaged)."""
    net, (x, y) = make_net(), batch()
    ref = make_net()
    opt = _Lookahead(torch.optim.SGD(ref.parameters(), lr=0.1))
    for _ in range(2):
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode="data_parallel")
        opt = _Lookahead(torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(2):
            nn.functional.cross_entropy(parallel(world.rows(x)), world.rows(y)).backward()
            opt.step()
            opt.zero_grad()
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
        )


def test_a_scalar_the_step_makes_comes_back_as_made() -> None:
    """A step returning a scalar it made (the scheduler's learning rate as a tensor): the mode
    averages returned scalars over the ranks, and a value every rank made alike comes back as
    made (a simulated world summed it once, not once a rank: it came back divided by the world
    size)."""
    net, (x, y) = make_net(), batch()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss, torch.tensor(sched.get_last_lr()[0])

        run = AutoParallel(step, parallel_mode="data_parallel")
        for want in (0.05, 0.025):
            _, lr = run(world.rows(x), world.rows(y))
            assert_matches_single_device(lr, torch.tensor(want))
