"""A call stopped part way to be planned again (another branch, an index of its own) runs again
from where it started: a module's own attributes the stopped attempt changed are put back first.

A module counter advanced in ``forward`` (``self.pos += 1``) before the op that stops the call
was advanced twice (the stopped attempt and the run again): the next index, branch or position
read from it was one call ahead of one device's, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = pytest.mark.usefixtures("one_thread")


class _Counted(nn.Module):
    """Reads a row of a whole table at a position it counts itself, and doubles its output on
    every other call: each call's index or branch differs from the last one's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(8, 6))
        self.lin = nn.Linear(6, 4)
        self.pos = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pos += 1
        h = self.lin(x + self.table[self.pos])
        return h * 2 if self.pos % 2 else h


def test_a_module_counter_read_after_a_stop_counts_once() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    single, net = _Counted(), _Counted()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        for call in range(4):
            with torch.no_grad():
                want = single(x)
                got = torch.cat(world.local_tensors(parallel(world.rows(x))), 0)
            assert net.pos == single.pos == call + 1
            assert_matches_single_device(got, want, what=f"call {call}")


NET: _Counted
OPT: torch.optim.Optimizer


def script_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A train step as a script writes it: the network and optimizer are globals."""
    loss = ((NET(x) - y) ** 2).mean()
    loss.backward()
    OPT.step()
    OPT.zero_grad()
    return loss


def test_a_train_step_with_a_counted_branch_matches_one_device() -> None:
    global NET, OPT
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    single = NET = _Counted()
    OPT = torch.optim.AdamW(NET.parameters(), lr=1e-2)
    want = [script_step(x, y).detach() for _ in range(4)]
    net = NET = _Counted()
    with simulated_world(2) as world:
        world.replicate(net)
        OPT = torch.optim.AdamW(net.parameters(), lr=1e-2)
        parallel = sw.AutoParallel(script_step, parallel_mode="semi_auto")
        for s in range(4):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
        assert net.pos == single.pos == 4
        for name, p in single.named_parameters():
            assert_matches_single_device(dict(net.named_parameters())[name], p, what=name)


class _Criterion(nn.Module):
    """A loss module outside the network that doubles its loss on every other call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = ((out - y) ** 2).mean()
        return loss * 2 if self.calls % 2 == 0 else loss


CRITERION: _Criterion
LINEAR: nn.Linear


def criterion_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = CRITERION(LINEAR(x), y)
    loss.backward()
    OPT.step()
    OPT.zero_grad()
    return loss


def test_a_counter_of_a_module_the_step_loads_outside_the_network_counts_once() -> None:
    global CRITERION, LINEAR, OPT
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    LINEAR, CRITERION = nn.Linear(6, 4), _Criterion()
    OPT = torch.optim.SGD(LINEAR.parameters(), lr=0.1)
    want = [criterion_step(x, y).detach() for _ in range(4)]
    torch.manual_seed(0)
    net = LINEAR = nn.Linear(6, 4)
    CRITERION = _Criterion()
    with simulated_world(2) as world:
        world.replicate(net)
        OPT = torch.optim.SGD(net.parameters(), lr=0.1)
        parallel = sw.AutoParallel(criterion_step, parallel_mode="semi_auto")
        for s in range(4):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[s], what=f"loss {s}")
    assert CRITERION.calls == 4


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.sub: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.sub(h) if self.sub is not None else h


def test_a_counter_of_a_module_added_after_the_first_plan_counts_once() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    single, net, subs = _Holder(), _Holder(), (_Counted(), _Counted())
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        for call in range(4):
            if call == 1:  # (planned again for the new module's ops, then its own index)
                single.sub = subs[0]
                world.replicate(subs[1])
                net.sub = subs[1]
            with torch.no_grad():
                want = single(x)
                got = torch.cat(world.local_tensors(parallel(world.rows(x))), 0)
            assert_matches_single_device(got, want, what=f"call {call}")
    assert subs[1].pos == subs[0].pos == 3
