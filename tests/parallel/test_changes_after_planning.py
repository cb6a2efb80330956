"""What a wrapper refuses once it has planned, rather than ignore: `dataset_strategy`, `hsdp`
and `comm_fusion` calls, a primitive's ``shard()`` or ``sw.shard``'s op form set on a module
after the first call (the plan and the parameters' storage keep what they were made with; each
was silently ignored: a ``dataset_strategy("data_parallel")`` after ``"full_batch"`` gave every
rank another loss), and a primitive made inside ``forward`` (never seen as a submodule) is
named with the fix. Refused calls change nothing: the next call matches one device again."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import assert_matches_single_device, simulated_world


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.mm = sw.ops.MatMul().shard(((2, 2), (2, 1)))
        self.w = nn.Parameter(torch.randn(32, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(torch.relu(self.l1(x)), self.w)


def mse_step(net: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A train step: `net`'s MSE loss, backward (no optimizer), the loss."""

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(net(a), b)
        loss.backward()
        return loss

    return step


def _setup() -> tuple[Net, Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    return net, copy.deepcopy(net), torch.randn(8, 16), torch.randn(8, 4)


def test_settings_and_strategies_changed_after_planning_are_refused() -> None:
    net, single, x, y = _setup()
    want = nn.functional.mse_loss(single(x), y)
    with simulated_world(4) as world:
        world.replicate(net)

        step = mse_step(net)
        wrapper = sw.AutoParallel(step, parallel_mode="semi_auto").dataset_strategy("full_batch")
        assert_matches_single_device(wrapper(world.same(x), world.same(y)), want)
        with pytest.raises(ValueError, match=r"dataset_strategy: call it before the first step"):
            wrapper.dataset_strategy("data_parallel")
        with pytest.raises(ValueError, match=r"hsdp: call it before the first step"):
            wrapper.hsdp()
        with pytest.raises(ValueError, match=r"comm_fusion: call it before the first step"):
            wrapper.comm_fusion({"allreduce": {"mode": "size", "config": 32}})
        planned = net.mm.in_strategy
        net.mm.shard(((4, 1), (1, 1)))
        with pytest.raises(ValueError) as err:
            wrapper(world.same(x), world.same(y))
        assert "mm (MatMul)'s sharding strategy changed after the first call" in str(err.value)
        assert "in_strategy ((2, 2), (2, 1))" in str(err.value)
        assert "wrap the network in a new AutoParallel" in str(err.value)
        net.mm.shard(planned)  # (back as planned: runs again, full batch as planned)
        assert_matches_single_device(wrapper(world.same(x), world.same(y)), want)
        sw.shard(net.l1, in_strategy=((2, 1), (2, 1)))
        with pytest.raises(ValueError, match=r"l1's sharding strategy changed .* in_strategy none"):
            wrapper(world.same(x), world.same(y))


class TwoHeads(Net):
    """`Net` with a second head the first plan does not run (used when asked)."""

    def __init__(self) -> None:
        super().__init__()
        self.other = sw.ops.MatMul()

    def forward(self, x: torch.Tensor, other: bool = False) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        return self.other(h, self.w) if other else self.mm(h, self.w)


def test_only_the_modules_a_plan_ran_are_held_to_it() -> None:
    """A primitive no plan ran yet may take a strategy after the first call (it is planned when
    first run); a module the plan ran replaced in the network is refused, naming it."""
    torch.manual_seed(0)
    net, x, y = TwoHeads(), torch.randn(8, 16), torch.randn(8, 4)
    with simulated_world(4) as world:
        world.replicate(net)

        wrapper = sw.AutoParallel(mse_step(net), parallel_mode="semi_auto")
        wrapper(world.rows(x), world.rows(y))
        net.other.shard(((4, 1), (1, 1)))  # (not run by the plan: fine)
        wrapper(world.rows(x), world.rows(y))
        net.mm = sw.ops.MatMul().shard(((2, 2), (2, 1)))
        with pytest.raises(ValueError, match=r"mm was replaced in the network after the first"):
            wrapper(world.rows(x), world.rows(y))


class Inline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sw.ops.Tanh()(x @ self.w)  # (a new primitive each call: not a submodule)


def test_a_primitive_made_inside_forward_is_named_with_the_fix() -> None:
    net, x = Inline(), torch.randn(4, 8)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).sum()
            loss.backward()
            return loss

        with pytest.raises(UnsupportedParallelError) as err:
            sw.AutoParallel(step, parallel_mode="semi_auto")(world.rows(x))
    msg = str(err.value)
    assert "%1 Tanh/Tanh is a shardwise primitive that is not a submodule of the network" in msg
    assert "create it in __init__ (self.op = sw.ops.Tanh(...))" in msg
