"""A wrapper garbage collected while another optimizer steps (semi_auto, with hsdp, and
data_parallel).

The wrappers' global optimizer step hooks go away with them; their finalizers removed the hooks
at once, and a collection inside a step (garbage collection runs at any allocation, here forced
by another hook) changed torch's dict of global hooks while the step iterated it: that
unrelated optimizer's step failed with ``RuntimeError: OrderedDict mutated during iteration``
(seen as a flaky failure of whichever test ran next in the process). The removal now waits for
the next registration (`optim._global_hooks`).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import shardwise as sw
from shardwise.testing import simulated_world


def _trained_wrapper(mode: str) -> tuple[Any, torch.optim.Optimizer]:
    net, x = nn.Linear(4, 2), torch.ones(4, 4)
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        wrapper = sw.AutoParallel(step, parallel_mode=mode.removesuffix("+hsdp"))
        if mode.endswith("+hsdp"):  # (optimizer parallel: its engine's hooks too)
            wrapper.hsdp(threshold=0)
        wrapper(world.rows(x))
    return wrapper, opt


@pytest.mark.parametrize("mode", ["semi_auto", "semi_auto+hsdp", "data_parallel"])
def test_a_wrapper_collected_during_another_optimizers_step(mode: str) -> None:
    held = [_trained_wrapper(mode)[0]]

    def drop(*_: Any) -> None:  # (the last reference goes, and a collection runs, mid-step)
        held.clear()
        gc.collect()

    handles = [register_optimizer_step_pre_hook(drop)]
    handles.append(register_optimizer_step_pre_hook(lambda *_: None))  # (iterated after it)
    other = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    before = other.weight.detach().clone()
    try:
        other(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    assert not held and not torch.equal(other.weight, before)  # (collected; the step ran)


def test_a_runner_collected_during_its_own_optimizers_step() -> None:
    """The same with the optimizer whose own step hooks the data-parallel runner holds (the
    network wrapped again, the first wrapper dropped while its optimizer still steps)."""
    wrapper, opt = _trained_wrapper("data_parallel")
    held = [wrapper]
    del wrapper

    def drop(*_: Any) -> None:
        held.clear()
        gc.collect()

    handles = [opt.register_step_pre_hook(drop), opt.register_step_pre_hook(lambda *_: None)]
    try:
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert not held


class Seeing(torch.optim.SGD):
    """SGD noting the closure each step is handed."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[Any] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.seen.append(closure)
        return super().step(closure)


def _handed(make_wrappers: Any) -> tuple[Any, Any]:
    """The closure a plain optimizer's step is handed while `make_wrappers()`'s result lives,
    and after it is dropped (collected), with the user's closure."""
    net = nn.Linear(2, 2)
    opt = Seeing(net.parameters())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = net(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    wrappers = make_wrappers()
    opt.step(closure)
    del wrappers
    gc.collect()
    opt.step(closure)
    assert all(getattr(c, "__wrapped__", c) is closure for c in opt.seen)
    return closure, opt.seen


def test_a_wrapper_without_hsdp_leaves_closures_alone() -> None:
    """A wrapper without optimizer parallel does not hand other optimizers' steps a wrapped
    closure (every wrapper did, for as long as it lived and until the next registration)."""
    closure, seen = _handed(lambda: [sw.AutoParallel(nn.Linear(2, 2), parallel_mode="semi_auto")])
    assert seen == [closure, closure]


def test_wrappers_with_hsdp_share_one_closure_hook_gone_with_the_last() -> None:
    """Three wrappers with hsdp wrap a closure once (not once each), and once they are dropped
    the closure is handed on unchanged (the dropped wrappers' hooks went on wrapping every
    closure until another hook was registered)."""

    def three() -> list[Any]:
        return [
            sw.AutoParallel(nn.Linear(2, 2), parallel_mode="semi_auto").hsdp(threshold=0)
            for _ in range(3)
        ]

    closure, seen = _handed(three)
    assert seen[0] is not closure and seen[0].__wrapped__ is closure  # (once)
    assert seen[1] is closure
