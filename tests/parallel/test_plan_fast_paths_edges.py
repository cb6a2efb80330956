"""Where the plan executor's fast paths must not apply, or must give way (`parallel._spans`).

Each case trains 6 steps (the fast paths start at the third) on 2 simulated ranks and equals one
device at every step, loss and every gradient:

- a block holding a shardwise primitive: its primitive runs through the executor;
- a dropout whose ``p`` goes from 0 to 0.1 at step 3 (a warm-up): from then on its masks are
  this rank's block of one global mask again;
- a block that raises at step 3, its caller falling back to skipping it: the ops after it are
  checked against the plan (planned again);
- a user's torch-function mode around the second of three forward passes in one call: the
  executor goes back under it after the optimizer step;
- a gradient penalty's ``torch.autograd.grad(..., create_graph=True)``;
- a branch on a Python flag inside a block, with the default ``watch_every_op=True`` (planned
  again; the other cases opt in to the fast paths with ``watch_every_op=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread", "fast_paths")


BATCH, STEPS = 8, 6


class Block(nn.Module):
    """Linear, tanh, (primitive ReLU), (dropout), (centering), linear, residual."""

    def __init__(self, primitive: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.act = sw.ops.ReLU() if primitive else None
        self.p, self.fail, self.center = 0.0, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * 2
        if self.act is not None:
            h = self.act(h)
        if self.fail:
            raise FloatingPointError("unstable block")
        if self.center:
            h = h - h.mean(0, keepdim=True)
        return self.b(F.dropout(h, self.p, self.training)) + x


class Net(nn.Module):
    def __init__(self, primitive: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(16, 16), Block(primitive), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with contextlib.suppress(FloatingPointError):  # (a guard's fallback: skip the block)
            h = self.block(h)
        return F.cross_entropy(self.out(h), y)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def _compare(make: Callable[[], Net], before_step: Callable[[Net, int], None]) -> None:
    """One device against 2 simulated ranks, `before_step(net, s)` run before each step."""
    batches, want = _data(), []
    net = make()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(7)
    for s, (x, y) in enumerate(batches):
        before_step(net, s)
        loss = net(x, y)
        loss.backward()
        want.append((loss.detach(), _grads(net)))
        opt.step()
        opt.zero_grad()
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        seen: list[dict[str, torch.Tensor]] = []

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(x, y)
            loss.backward()
            seen.append(_grads(net))
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        torch.manual_seed(7)
        for s, (x, y) in enumerate(batches):
            before_step(net, s)
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
            assert_matches_single_device(seen[-1], want[s][1], what=f"grads {s}")


def _set(attr: str, value: Callable[[int], Any]) -> Callable[[Net, int], None]:
    return lambda net, s: setattr(net.block, attr, value(s))


@pytest.mark.parametrize(
    "case",
    ["primitive", "dropout warm-up", "raises at step 3"],
)
def test_fast_paths_give_way(case: str) -> None:
    if case == "primitive":
        _compare(lambda: Net(primitive=True), lambda net, s: None)
    elif case == "dropout warm-up":
        _compare(Net, _set("p", lambda s: 0.0 if s < 3 else 0.1))
    else:
        _compare(Net, _set("fail", lambda s: s == 3))


@pytest.fixture
def default_context() -> Iterator[None]:
    sw.reset_auto_parallel_context()  # (the default: watch_every_op=True)
    yield


@pytest.mark.usefixtures("default_context")
def test_a_branch_inside_a_block_is_planned_again_by_default() -> None:
    """From step 4 the block centres its activations over the batch (a mean over the rows:
    an AllReduce under data parallel); watching every op (the default), the executor sees the
    new ops and plans again."""
    _compare(Net, _set("center", lambda s: s >= 4))


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_user_mode_entered_after_the_optimizer_step() -> None:
    batches, want = _data()[:2], []
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        for _ in range(3):
            loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(loss.detach())
    net, got = Net(), []
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            for cycle in range(3):
                with _Passing() if cycle == 1 else contextlib.nullcontext():
                    loss = net(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                got.append(loss.detach().clone())

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for x, y in batches:
            parallel(world.rows(x), world.rows(y))
    for k, (g, w) in enumerate(zip(got[-len(want) :], want, strict=True)):
        assert_matches_single_device(g, w, what=f"loss {k}")


def test_a_gradient_penalty_with_create_graph() -> None:
    x, y = _data()[0]
    net = Net()
    loss = net(x, y)
    want = torch.autograd.grad(loss, list(net.parameters()))
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)
        got: list[Any] = []

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = net(a, b)
            got.append(torch.autograd.grad(loss, list(net.parameters()), create_graph=True))
            return loss

        sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(x), world.rows(y))
        for g, w in zip(got[-1], want, strict=True):
            assert_matches_single_device(g.detach(), w, what="gradient")
