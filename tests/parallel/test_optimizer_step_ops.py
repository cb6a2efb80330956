"""Optimizer steps inside a wrapped train step: after the plan's ops ran, the update's ops pass
through the plan executor untouched; a step with a closure (which re-runs the network) runs the
plan again, so its loss is still the global one; a loss computed after the step (the network run
again) too; a step that raises leaves no mode behind. 2 simulated ranks, results equal
single-device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel
from shardwise.testing import simulated_world


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


class Net(nn.Module):
    """A linear layer and a shardwise primitive."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.act = sw.ops.Tanh()

    @property
    def weight(self) -> torch.Tensor:
        return self.lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.lin(x))
        return out


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


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
def test_steps_and_closures_match_one_device(closure: bool) -> None:
    want_loss, want_weight = single_device(closure)
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
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

        loss = AutoParallel(train_step, parallel_mode="semi_auto")(world.rows(x), world.rows(y))
        got_weight = world.local(net.weight.detach(), 0)
        got_loss = float(world.local(loss, 0))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_weight, want_weight, rtol=1e-6, atol=1e-7)


class StackDepth(torch.optim.SGD):
    """SGD that records the torch-function mode stack's depth when it updates (and can fail)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.depths: list[int] = []
        self.fail = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        self.depths.append(torch._C._len_torch_function_stack())
        if self.fail:
            raise RuntimeError("step failed")
        return super().step(closure)


class Passing(torch.overrides.TorchFunctionMode):
    """A user's mode that lets everything through."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def after_step_loss_single_device() -> float:
    """One SGD step, then the loss of the updated net on the same batch (one device)."""
    net, (x, y) = make_net(), batch()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return float(nn.functional.cross_entropy(net(x), y).detach())


def step_then_loss(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> AutoParallel:
    """The wrapped train step: backward, ``opt.step()`` inside ``around()``, then the loss of the
    updated net on the same batch (examined: the global batch's loss)."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nn.functional.cross_entropy(net(x), y).backward()
        with around():
            opt.step()
        loss: torch.Tensor = nn.functional.cross_entropy(net(x), y)
        return loss

    return AutoParallel(train_step, parallel_mode="semi_auto", network=net, optimizer=opt)


@pytest.mark.parametrize("user_mode", [False, True], ids=["plain", "under-a-user-mode"])
def test_loss_after_the_step_runs_the_plan_again(user_mode: bool) -> None:
    """The network run again after ``opt.step()`` (the loss of the updated net) runs the plan
    again: the loss of the global batch. The optimizer steps with the plan executor taken off
    the mode stack, or, under a user's mode on top of it, with both on the stack (the executor
    paused); every mode is off the stack afterwards."""
    want = after_step_loss_single_device()
    net, (x, y) = make_net(), batch()
    base = torch._C._len_torch_function_stack()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = StackDepth(net.parameters(), lr=0.1)
        step = step_then_loss(net, opt, Passing if user_mode else contextlib.nullcontext)
        got = float(world.local(step(world.rows(x), world.rows(y)), 0).detach())
        inside = torch._C._len_torch_function_stack()
    assert opt.depths == ([base + 2] if user_mode else [base])  # (executor and user) or none
    assert inside == base  # every mode exited
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_step_that_raises_leaves_no_mode_behind() -> None:
    """The step raises: the wrapped call raises, the stack is back to what it was, and the next
    call runs the plan with the right result."""
    want = after_step_loss_single_device()
    net, (x, y) = make_net(), batch()
    base = torch._C._len_torch_function_stack()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = StackDepth(net.parameters(), lr=0.1)
        step = step_then_loss(net, opt)
        opt.fail = True
        with pytest.raises(RuntimeError, match="step failed"):
            step(world.rows(x), world.rows(y))
        assert torch._C._len_torch_function_stack() == base
        opt.fail = False
        for p in net.parameters():
            p.grad = None
        got = float(world.local(step(world.rows(x), world.rows(y)), 0).detach())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


class Outer(torch.optim.SGD):
    """SGD whose step first steps an inner optimizer that raises (and is caught)."""

    inner: StackDepth

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        with contextlib.suppress(RuntimeError):
            self.inner.step()
        return super().step(closure)


def test_steps_outside_wrapped_calls_and_raising_inner_steps_leave_nothing_behind() -> None:
    """An optimizer stepping (and raising) outside any wrapped call leaves the mode stack as it
    was; an inner step that raised inside an outer one changes nothing: the loss after it is
    the global batch's."""
    lone = StackDepth([torch.zeros(2, requires_grad=True)], lr=0.1)
    lone.fail = True
    base = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError):
        lone.step()
    assert torch._C._len_torch_function_stack() == base

    want = after_step_loss_single_device()
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = Outer(net.parameters(), lr=0.1)
        opt.inner = lone

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            return nn.functional.cross_entropy(net(x), y)

        step = AutoParallel(train_step, parallel_mode="semi_auto")
        got = float(world.local(step(world.rows(x), world.rows(y)), 0).detach())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
