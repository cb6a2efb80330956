"""In-place changes the executor cannot hand on, gradient accumulation through submodules, and
Python numbers in factories.

- Item assignment on a value the plan moves first (``out[:, 0] = 0.0``: the plan gathers
  ``out`` for it) and an in-place change through a view when the view or its base is moved
  would land in a moved copy while later ops read the network's own tensor: a `PlanError`
  naming the op and the out-of-place form (before: silently the unchanged values, loss 0.1259
  against 0.1066). ``buf[:, :4].copy_(h[:, :4])`` on a zeros buffer, refused so before, now
  runs the slice and the copy on ``buf`` as placed.
- A view is any op whose output shares its input's storage, read from the alias annotations
  of its aten ops' schemas (``o.detach()``, ``o.float()`` on a float32 ``o``, ``o.unfold``),
  not a list of names: ``o.detach().mul_(0.5)`` after a row-parallel layer the automatic
  planners chose moved ``o`` for ``detach``, and ``mul_`` halved the moved copy (loss 1.3311
  against 1.3500, silently). The automatic planners now run a view that is changed in place,
  and the change, on the value as it is placed, as semi_auto does (``o.t().mul_(0.5)`` was
  refused there before); where no rule runs them so, a `PlanError`.
- A step that accumulates gradients by calling the network's submodules (``net[0](c)``) never
  runs the network's own forward; its second pass restarts at the first op that reads a
  parameter (before: it ran outside the plan on the weight blocks, silently).
- ``torch.tensor(n)`` and ``torch.full((1,), n)`` of an int passed per call (4, 2, 1) keep
  each call's value (before: the captured 4, where 2 and 1 are its share at 2 and 4 ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import PlanError
from shardwise.testing import assert_matches_single_device, simulated_world

from ..zoo import assert_grad_blocks_match
from .test_step_outputs import BATCH, D, batch, make_net, megatron, run


def test_item_assignment_on_a_value_the_plan_moves_is_refused() -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = net(x)
        out[:, 0] = 0.0
        loss = out.pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(PlanError, match=r"__setitem__ .* sets items of a value in place"):
        run(step, batch())


def test_a_change_through_a_view_of_a_buffer_runs_on_the_buffer() -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        h = torch.tanh(net[0](x))
        buf = torch.zeros(BATCH, 2 * D)
        buf[:, :4].copy_(h[:, :4])
        loss = net[2](buf + h).pow(2).mean()
        loss.backward()
        return loss

    want = step(make_net(), batch())
    got, _ = run(step, batch())  # (the slice and copy_ on buf as placed: no move, no copy)
    assert_matches_single_device(got, want.detach(), what="loss")


@pytest.mark.parametrize("annotated", [False, True])
def test_gradient_accumulation_through_submodules_matches_one_device(annotated: bool) -> None:
    def step_of(net: nn.Sequential) -> Any:
        def step(x: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(())
            for c in x.chunk(2):
                loss = net[2](torch.tanh(net[0](c))).pow(2).mean() / 2
                loss.backward()
                total = total + loss.detach()
            return total

        return step

    single, x = make_net(), batch()
    want = step_of(single)(x)
    net = make_net()
    with simulated_world(4) as world:
        world.replicate(net)
        if annotated:
            megatron(net)
        loss = sw.AutoParallel(step_of(net), network=net)(world.rows(x))
        assert_matches_single_device(loss, want, what="loss")
        grads = {n: p.grad for n, p in single.named_parameters()}
        for name, p in net.named_parameters():
            block = grads[name]
            if annotated:  # (the Megatron blocks: rows / columns over mp)
                plan = megatron_block(name)
                block = plan(block)
            assert_matches_single_device(p.grad, block, what=f"{name}.grad")


def megatron_block(name: str) -> Any:
    """rank -> this rank's block of `name`'s gradient under `megatron` at dp 2 x mp 2."""
    dim = {"0.weight": 0, "0.bias": 0, "2.weight": 1}.get(name)

    def block(full: torch.Tensor) -> Any:
        if dim is None:
            return full
        return lambda rank: full.chunk(2, dim)[rank % 2]

    return block


@pytest.mark.parametrize("make", ["tensor", "full"])
def test_a_per_call_number_in_a_factory_is_kept(make: str) -> None:
    def step_of(net: nn.Sequential) -> Any:
        def step(x: torch.Tensor, k: int) -> torch.Tensor:
            n = (4, 2, 1)[k]  # (an int the captured 4 divides by a split count: data, no size)
            scale = torch.tensor(n) if make == "tensor" else torch.full((1,), n)
            loss = (net(x) * scale).pow(2).mean()
            loss.backward()
            return loss

        return step

    single, x = make_net(), batch()
    net = make_net()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(step_of(net), network=net)
        for k in (0, 1, 2):
            want = step_of(single)(x, k)
            assert_matches_single_device(parallel(world.rows(x), k), want, what=f"call k={k}")


class WrittenThrough(nn.Module):
    """``o = fc2(tanh(fc1(x)))`` changed in place through a view of it (`form`), then read."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.fc2(torch.tanh(self.fc1(x)))
        views = {
            "detach": o.detach,
            "t": o.t,
            "detach_t": lambda: o.detach().t(),
            "float": o.float,  # (o itself: float32 already)
            "unfold": lambda: o.unfold(1, 4, 4),
        }
        if self.form == "add":
            o.detach().add_(1.0)
        else:
            views[self.form]().mul_(0.5)
        out: torch.Tensor = self.fc3(torch.tanh(o))
        return out


def _written_through(form: str, mode: str) -> None:
    """One train step on 2 ranks (fc1 column parallel): loss and gradients as one device's."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    ref = WrittenThrough(form)
    want = F.cross_entropy(ref(x), y)
    want.backward()
    net = WrittenThrough(form)
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((1, 1), (2, 1)))

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(a), b)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode)
        got = parallel(world.rows(x), world.rows(y))
        assert_matches_single_device(got, want.detach(), what="loss")
        assert_grad_blocks_match(parallel, net, ref)


MODES = ["semi_auto", "sharding_propagation", "recursive_programming"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["detach", "t", "detach_t", "float"])
def test_a_change_through_a_view_of_a_partial_sum_matches_one_device(form: str, mode: str) -> None:
    _written_through(form, mode)


@pytest.mark.parametrize(
    ("form", "mode"),
    [("unfold", "semi_auto"), ("unfold", "sharding_propagation"), ("add", "sharding_propagation")],
)
def test_a_change_through_a_view_no_rule_keeps_in_place_is_refused(form: str, mode: str) -> None:
    with pytest.raises(PlanError, match=r"_ \(.*\) changes a view of a value in place"):
        _written_through(form, mode)
