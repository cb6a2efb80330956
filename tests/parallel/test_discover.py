"""How `AutoParallel(train_step)` finds the step's network and optimizers (no ``network=``).

Only what the step's code really loads counts: a global that merely shares a name with an
attribute the step reads (``optimizer.step()`` and a wrapper named ``step``) is ignored, as is a
wrapper re-created the way a notebook cell re-runs. The network and optimizer are also found
through an object's attributes (``trainer.net``, ``self.net``), in a helper function the step
calls, in a nested function or lambda, and in a step written as a class with ``__call__``.
Each is then trained for one step on 2 simulated ranks and compared with one device.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import SimulatedWorld, assert_matches_single_device, simulated_world

torch.manual_seed(0)
X, Y = torch.randn(8, 6), torch.randint(0, 3, (8,))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def fresh(world: SimulatedWorld | None = None) -> tuple[Net, torch.optim.Optimizer]:
    """The network (every rank's copy inside a simulated `world`) and its optimizer."""
    if world is None:
        torch.manual_seed(1)
        net = Net()
    else:
        with world.outside():
            torch.manual_seed(1)
            net = Net()
        world.replicate(net)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


net, optimizer = fresh()


def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


step: Any = None  # the wrapper, under the most natural name (also an attribute the step reads)


def test_a_global_named_like_an_attribute_is_ignored() -> None:
    global step
    step = sw.AutoParallel(train_step)
    assert step.network is net and step.optimizers == [optimizer]
    again = sw.AutoParallel(train_step)  # a notebook cell run again: `step` holds a wrapper
    assert again.network is net and again.optimizers == [optimizer]
    step = again
    assert sw.AutoParallel(train_step).network is net
    step = None


class Trainer:
    def __init__(self, world: SimulatedWorld | None = None) -> None:
        self.net, self.opt = fresh(world)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


class CallableTrainer(Trainer):
    """A train step written as a class with ``__call__`` (not a module)."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.step(x, y)


class InheritedCall(CallableTrainer):
    """Its ``__call__`` is its base class's."""


trainer = Trainer()


def through_attribute(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(trainer.net(x), y)
    loss.backward()
    trainer.opt.step()
    trainer.opt.zero_grad()
    return loss


helper_net, helper_opt = fresh()


def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(helper_net(x), y)


def update() -> None:
    helper_opt.step()
    helper_opt.zero_grad()


def with_helpers(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = forward_loss(x, y)
    loss.backward()
    update()
    return loss


def make_nested(world: SimulatedWorld | None = None) -> tuple[Any, Net, torch.optim.Optimizer]:
    inner_net, inner_opt = fresh(world)

    def nested(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = (lambda t: inner_net(t))(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()

        def finish() -> None:
            inner_opt.step()
            inner_opt.zero_grad()

        finish()
        return loss

    return nested, inner_net, inner_opt


def explicit(
    net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def make_defaults(world: SimulatedWorld | None = None) -> tuple[Any, Net, torch.optim.Optimizer]:
    net, opt = fresh(world)

    def with_defaults(
        x: torch.Tensor, y: torch.Tensor, net: nn.Module = net, opt: Any = opt
    ) -> torch.Tensor:
        return explicit(net, opt, x, y)

    return with_defaults, net, opt


def single_device_loss_and_params() -> tuple[float, dict[str, torch.Tensor]]:
    ref, opt = fresh()
    loss = nn.functional.cross_entropy(ref(X), Y)
    loss.backward()
    opt.step()
    return loss.item(), {n: p.detach().clone() for n, p in ref.named_parameters()}


def cases(world: SimulatedWorld | None) -> dict[str, tuple[Any, nn.Module, torch.optim.Optimizer]]:
    """Each way of reaching the network, built anew (inside `world` when given)."""
    global trainer, helper_net, helper_opt
    trainer, bound, called = Trainer(world), Trainer(world), CallableTrainer(world)
    inherited = InheritedCall(world)
    helper_net, helper_opt = fresh(world)
    nested, inner_net, inner_opt = make_nested(world)
    partial_net, partial_opt = fresh(world)
    defaults = make_defaults(world)
    return {
        "object attribute": (through_attribute, trainer.net, trainer.opt),
        "bound method": (bound.step, bound.net, bound.opt),
        "object with __call__": (called, called.net, called.opt),
        "__call__ of a base class": (inherited, inherited.net, inherited.opt),
        "helper functions": (with_helpers, helper_net, helper_opt),
        "nested function and lambda": (nested, inner_net, inner_opt),
        "functools.partial": (
            functools.partial(explicit, partial_net, partial_opt),
            partial_net,
            partial_opt,
        ),
        "default arguments": defaults,
    }


@pytest.mark.parametrize("case", list(cases(None)))
def test_found_and_trained(case: str) -> None:
    fn, want_net, want_opt = cases(None)[case]
    wrapper = sw.AutoParallel(fn)
    assert wrapper.network is want_net and wrapper.optimizers == [want_opt]
    want_loss, want_params = single_device_loss_and_params()
    with simulated_world(2) as world:
        fn, net, _ = cases(world)[case]
        loss = sw.AutoParallel(fn)(world.rows(X), world.rows(Y))
        assert_matches_single_device(loss, torch.tensor(want_loss))
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), want_params[name], what=name)


def test_two_unrelated_networks_still_ask_for_network() -> None:
    other = nn.Linear(6, 3)
    with pytest.raises(ValueError, match=r"2 modules with parameters .*pass network="):
        sw.AutoParallel(lambda x: net(x) + other(x))


def test_recreated_wrapper_takes_over() -> None:
    """A cell that builds the wrapper, run twice before training: the second wrapper trains;
    once it has planned (the parameters are blocks), a third one is refused with the fix."""
    want_loss, want_params = single_device_loss_and_params()
    with simulated_world(2) as world:
        t = Trainer(world)
        sw.AutoParallel(t.step)
        wrapped = sw.AutoParallel(t.step)
        loss = wrapped(world.rows(X), world.rows(Y))
        assert_matches_single_device(loss, torch.tensor(want_loss))
        for name, p in t.net.named_parameters():
            assert_matches_single_device(p.detach(), want_params[name], what=name)
        with pytest.raises(ValueError, match=r"already run .* keep calling that wrapper"):
            sw.AutoParallel(t.step)


def test_superseded_and_running_wrappers_in_data_parallel_mode() -> None:
    """data_parallel mode: a wrapper that never ran is superseded (calling it names the newer
    one); once one ran (its optimizer hooks average the gradients) a new one is refused,
    instead of silently removing the running one's hooks."""
    want_loss, _ = single_device_loss_and_params()
    with simulated_world(2) as world:
        t = Trainer(world)
        first = sw.AutoParallel(t.step, parallel_mode="data_parallel")
        second = sw.AutoParallel(t.step, parallel_mode="data_parallel")
        with pytest.raises(ValueError, match=r"wraps Net; call that one .*branches on a flag"):
            first(world.rows(X), world.rows(Y))
        loss = second(world.rows(X), world.rows(Y))
        assert_matches_single_device(loss, torch.tensor(want_loss))
        with pytest.raises(ValueError, match=r"already run .*data_parallel: its optimizer hooks"):
            sw.AutoParallel(t.net, parallel_mode="data_parallel", optimizer=t.opt)


def test_steps_with_constant_tuples_and_keywords() -> None:
    """Code with tuple constants (``()``, ``("a", "b")``) and keyword calls reads as well."""

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).sum(dim=(), keepdim=False) if x.dim() == 9 else net(x).sum()
        loss.backward(gradient=torch.ones(()))
        optimizer.step(*())
        return loss

    assert sw.AutoParallel(step).network is net
