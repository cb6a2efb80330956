"""In-place changes the executor cannot hand on, gradient accumulation through submodules, and
Python numbers in factories.

- Item assignment on a value the plan moves first (``out[:, 0] = 0.0``: the plan gathers
  ``out`` for it) and an in-place change through a view when the view or its base is moved
  (``buf[:, :4].copy_(h[:, :4])`` on a buffer the plan cuts) would land in a moved copy while
  later ops read the network's own tensor: a `PlanError` naming the op and the out-of-place
  form (before: silently the unchanged values, loss 0.1259 against 0.1066).
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
from torch import nn

import shardwise as sw
from shardwise.planner import PlanError
from shardwise.testing import assert_matches_single_device, simulated_world

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


def test_a_change_through_a_view_of_a_moved_buffer_is_refused() -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        h = torch.tanh(net[0](x))
        buf = torch.zeros(BATCH, 2 * D)
        buf[:, :4].copy_(h[:, :4])
        loss = net[2](buf + h).pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(PlanError, match=r"copy_ .* changes a view of a value in place"):
        run(step, batch())


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
