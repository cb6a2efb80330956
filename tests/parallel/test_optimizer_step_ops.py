"""While an optimizer steps (no closure) inside a wrapped train step, the data-parallel torch-op
mode lets the update's ops through unexamined; a step with a closure (which re-runs the network)
is examined as usual, so its loss is still the global one. 2 simulated ranks, plain data
parallel, results equal single-device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn

import shardwise as sw
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


class Net(nn.Module):
    """A linear layer and a shardwise primitive: the primitive runtime (and its torch-op mode)
    runs it."""

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

        loss = AutoParallel(train_step, parallel_mode="semi_auto")(world.rows(x), world.rows(y))
        got_weight = world.local(net.weight.detach(), 0)
        got_loss = float(world.local(loss, 0))
    # the global step hooks run before the optimizer's body: one active mode, counting
    assert opt.seen == ([[0]] if closure else [[1]])
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


@pytest.mark.parametrize("user_mode", [False, True], ids=["lifted", "under-a-user-mode"])
def test_step_runs_with_the_mode_off_the_stack_and_it_comes_back(user_mode: bool) -> None:
    """A plain step runs with the mode lifted off the torch-function stack (no dispatch per op);
    the ops after it are examined again (the loss after the step is the global one). Under a
    user's mode on top, nothing is lifted and the step passes through as before."""
    want = after_step_loss_single_device()
    net, (x, y) = make_net(), batch()
    base = torch._C._len_torch_function_stack()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = StackDepth(net.parameters(), lr=0.1)
        step = step_then_loss(net, opt, Passing if user_mode else contextlib.nullcontext)
        got = float(world.local(step(world.rows(x), world.rows(y)), 0).detach())
        inside = torch._C._len_torch_function_stack()
    assert opt.depths == ([base + 2] if user_mode else [base])  # lifted: ours is off the stack
    assert inside == base  # every mode exited
    hooks = torch_optimizer._global_optimizer_pre_hooks  # type: ignore[attr-defined]
    assert next(iter(hooks)) == _torchops._STEP_HOOKS[0].id  # runs before optimizer parallel's
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_step_that_raises_leaves_no_mode_behind() -> None:
    """The step raises with the mode lifted: the wrapped call raises, the stack is back to what it
    was, and the next call runs data parallel with the right result."""
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
        assert not _torchops._lifted() and not list(_torchops._ACTIVE)
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
    """An optimizer stepping (and raising) outside any wrapped call records nothing; an inner
    step that raised inside an outer one is dropped when the outer step ends, which puts the mode
    back: the loss after it is the global batch's."""
    lone = StackDepth([torch.zeros(2, requires_grad=True)], lr=0.1)
    lone.fail = True
    with pytest.raises(RuntimeError):
        lone.step()
    assert not _torchops._lifted()

    want = after_step_loss_single_device()
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = Outer(net.parameters(), lr=0.1)
        opt.inner = lone

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            assert not _torchops._lifted()  # the inner step's entry went with the outer one
            return nn.functional.cross_entropy(net(x), y)

        step = AutoParallel(train_step, parallel_mode="semi_auto")
        got = float(world.local(step(world.rows(x), world.rows(y)), 0).detach())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
