"""A buffer re-assigned in ``forward`` to a value the plan holds as a block is stored whole.

``self.rm = 0.9 * self.rm + 0.1 * h.detach().mean(0)`` on rows split over dp (or columns split
over mp) left each rank's buffer holding its own block of the new value (the mean of its rows,
never reduced): the ranks' state dicts differed, the eval loss through the wrapper was not one
device's, and under a column-parallel layer the next call refused the block as the whole
buffer. The capture now notes the buffers a call re-assigns (`ParallelPlan.set_buffers`), and
the executor makes the value whole before it stays in the buffer (`parallel/_leaving.py`), as
the in-place form (``self.rm.mul_(0.9).add_(...)``) already was.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import ParallelPlan, capture, plan_semi_auto
from shardwise.testing import simulated_world

STEPS = 3


class Net(nn.Module):
    def __init__(self, head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(6, 4)
        self.h = nn.Linear(4, 4) if head else nn.Identity()
        self.register_buffer("rm", torch.zeros(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        if self.training:
            self.rm = 0.9 * self.rm + 0.1 * h.detach().mean(0)  # (re-assigned, not in place)
        return F.cross_entropy(self.h(h - self.rm), y)


g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
EVAL = DATA.pop()


def _reference(head: bool, passes: int) -> tuple[list[torch.Tensor], list[float], float]:
    """One device: the buffer after each step, each step's loss and the eval loss."""
    ref = Net(head)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    buffers, losses = [], []
    for x, y in DATA:
        for _ in range(passes):
            loss = ref(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        buffers.append(ref.rm.clone())
        losses.append(loss.item())
    ref.eval()
    with torch.no_grad():
        return buffers, losses, ref(*EVAL).item()


def _check_ranks(world: sw.testing.SimulatedWorld, net: Net, want: torch.Tensor) -> None:
    for rank, got in enumerate(world.local_tensors(net.state_dict()["rm"])):
        torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {r}: {m}")


def _train_and_check(
    world: sw.testing.SimulatedWorld,
    wrapped: Any,
    net: Net,
    want: list[torch.Tensor],
    losses: list[float],
) -> None:
    """A wrapped train step over `DATA`: each step's loss and every rank's buffer as one
    device's."""
    for (x, y), rm, loss_1 in zip(DATA, want, losses, strict=True):
        loss = wrapped(world.rows(x), world.rows(y))
        for got in world.local_tensors(loss):
            assert got.item() == pytest.approx(loss_1, abs=1e-5)
        _check_ranks(world, net, rm)


@pytest.mark.parametrize("ranks", [2, 4])
def test_module_buffer_reassigned_in_forward_matches_one_device(ranks: int) -> None:
    want, losses, eval_loss = _reference(head=False, passes=1)
    net = Net()
    with simulated_world(ranks) as world:
        world.replicate(net)
        p = sw.AutoParallel(net, parallel_mode="semi_auto")
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for (x, y), rm, loss_1 in zip(DATA, want, losses, strict=True):
            loss = p(world.rows(x), world.rows(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            for got in world.local_tensors(loss):
                assert got.item() == pytest.approx(loss_1, abs=1e-5)
            _check_ranks(world, net, rm)
        net.eval()
        with torch.no_grad():
            out = p(world.rows(EVAL[0]), world.rows(EVAL[1]))
        for got in world.local_tensors(out):
            assert got.item() == pytest.approx(eval_loss, abs=1e-5)


@pytest.mark.parametrize("column_parallel", [False, True])
def test_train_step_buffer_reassigned_in_forward_matches_one_device(
    column_parallel: bool,
) -> None:
    """A train step on 4 ranks (dp 4, or dp 2 x mp 2 with the first layer column parallel:
    the new value is split over mp, and the second call refused the block as the buffer);
    evaluation through the same wrapper (a ``train`` flag)."""
    want, losses, eval_loss = _reference(head=True, passes=1)
    net = Net(head=True)
    with simulated_world(4) as world:
        world.replicate(net)
        if column_parallel:
            sw.shard(net.l, in_strategy=((2, 1), (2, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.5)

        def step(x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
            net.train(train)
            if not train:
                with torch.no_grad():
                    return net(x, y)
            loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        p = sw.AutoParallel(step, parallel_mode="semi_auto")
        _train_and_check(world, p, net, want, losses)
        out = p(world.rows(EVAL[0]), world.rows(EVAL[1]), train=False)
        for got in world.local_tensors(out):
            assert got.item() == pytest.approx(eval_loss, abs=1e-5)


def test_buffer_reassigned_in_each_accumulated_pass_matches_one_device() -> None:
    """Gradient accumulation: the second pass reads the buffer the first one set, whole."""
    want, losses, _ = _reference(head=False, passes=2)
    net = Net()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.5)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                loss = net(x, y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        p = sw.AutoParallel(step, parallel_mode="semi_auto")
        _train_and_check(world, p, net, want, losses)


def test_plan_notes_the_reassigned_buffer_and_keeps_it_in_json() -> None:
    net = Net()
    plan = plan_semi_auto(capture(net, *DATA[0]), 2)
    ((name, value),) = plan.set_buffers.items()
    assert name == "rm"
    assert plan.nodes[int(value[1:])].name.endswith("add")  # (0.9 * rm + 0.1 * mean)
    assert ParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    net.eval()  # (no re-assignment: nothing noted)
    assert not plan_semi_auto(capture(net, *DATA[0]), 2).set_buffers
