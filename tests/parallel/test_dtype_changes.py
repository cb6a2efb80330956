"""A parameter dtype change between calls of a wrapped step (``net.to(torch.float64)``).

semi_auto's gradient buckets kept the flat buffers, hooks and gradient-storing autograd nodes
made for the first dtype, and its plans the first dtype's bytes: from the call after the change
on, the loss still matched but the gradients did not (one rank's, or of the wrong sign, the
hooks no longer running). Now the call is planned again for the new dtypes (that plan the only
one kept: a plan made before for the same input shapes is not picked again) and the buckets are
made anew. With optimizer parallel (hsdp), whose shards are planned once, the change is refused
with a ValueError naming the parameter and the fix. ``parallel_mode="data_parallel"`` was right
already and stays so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import ParallelPlan
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
DATA = [  # (batch sizes 8, 4, 8, 4: the plan for 8 rows is made for float32, then float64)
    (torch.randn(b, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (b,), generator=g))
    for b in (8, 4, 8, 4)
]
CHANGE_AT = 2  # (after a plan for each batch size)


def build(megatron: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if megatron:
        sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
        sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
    return net


def train(net: nn.Module, call: Any) -> list[Any]:
    """Each call's result; the network made float64 before call `CHANGE_AT`."""
    out = []
    for i, (x, y) in enumerate(DATA):
        if i == CHANGE_AT:
            net.to(torch.float64)
        out.append(call(x.to(next(net.parameters()).dtype), y))
    return out


def stepper(net: nn.Module, grads: list[dict[str, torch.Tensor]] | None = None) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if grads is not None:
            grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        return loss

    return step


def block_of(full: torch.Tensor, layout: Any) -> Callable[[int], torch.Tensor]:
    """Rank -> its block of `full` under `layout`."""
    return lambda r: full[layout.local_index(r, tuple(full.shape))]


def matches_by_blocks(plan: ParallelPlan, run: Any, one: Any) -> None:
    """`run` = (losses, each step's gradients by name, network) of a wrapped run against `one`,
    the same of the single-device run: each loss equal, and each rank's gradient and final
    parameter its block of the single device's under the plan's layout."""
    (got, seen, net), (losses, grads, ref) = run, one
    for i, (loss, want) in enumerate(zip(got, losses, strict=True)):
        assert_matches_single_device(loss, want, what=f"loss {i}")
        for name, full in grads[i].items():
            block = block_of(full, plan.params[name].layout)
            assert_matches_single_device(seen[i][name], block, what=f"grad {i} {name}")
    for name, p in ref.named_parameters():
        block = block_of(p.detach(), plan.params[name].layout)
        assert_matches_single_device(net.get_parameter(name).detach(), block, what=name)


def single_device() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], nn.Module]:
    ref = build()
    grads: list[dict[str, torch.Tensor]] = []
    one = stepper(ref, grads)
    losses = train(ref, lambda x, y: one(x, y).detach())
    return losses, grads, ref


@pytest.mark.parametrize(("ranks", "megatron"), [(2, False), (4, True)])
def test_semi_auto_after_a_dtype_change_trains_as_one_device(ranks: int, megatron: bool) -> None:
    losses, grads, ref = single_device()
    net = build(megatron)
    seen: list[dict[str, torch.Tensor]] = []
    with simulated_world(ranks) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, seen), parallel_mode="semi_auto")
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)))
        plan = parallel.parallel_plan
        assert plan is not None
        matches_by_blocks(plan, (got, seen, net), (losses, grads, ref))
        # (the plan that runs, and the reports read, is the new dtype's)
        assert {p.dtype for p in plan.params.values()} == {"float64"}, plan.params


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_dtype_change_under_optimizer_parallel_is_refused(level: str) -> None:
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        x, y = DATA[0]
        parallel(world.rows(x.float()), world.rows(y))
        net.to(torch.float64)
        with pytest.raises(ValueError, match=r"'0\.weight'.*float64.*before the first call"):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize("level", [None, "level1"])
def test_data_parallel_after_a_dtype_change_trains_as_one_device(level: str | None) -> None:
    losses, _, ref = single_device()
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="data_parallel")
        if level is not None:
            parallel.hsdp(threshold=0, optimizer_level=level)
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)))
        for i, (loss, want) in enumerate(zip(got, losses, strict=True)):
            assert_matches_single_device(loss, want, what=f"loss {i}")
        if level is None:
            full = {n: p.detach() for n, p in ref.named_parameters()}
            assert_matches_single_device(
                {n: p.detach() for n, p in net.named_parameters()}, full, what="parameters"
            )


def test_a_conversion_that_changes_nothing_keeps_the_gradients_reduced() -> None:
    """``net.float()`` on a float32 network swaps the parameters' contents all the same (a
    simulated world's LocalTensors; ``set_swap_module_params_on_conversion(True)`` in a real
    job), which left their backward hooks behind: each rank kept its own gradient, silently."""
    ref, net = build(), build()
    want: list[dict[str, torch.Tensor]] = []
    seen: list[dict[str, torch.Tensor]] = []
    one = stepper(ref, want)
    data = [(x.float(), y) for x, y in DATA[:3]]
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, seen), parallel_mode="semi_auto")
        for i, (x, y) in enumerate(data):
            if i == 1:
                ref.float()
                net.float()
            one(x, y)
            parallel(world.rows(x), world.rows(y))
    for i, (got, full) in enumerate(zip(seen, want, strict=True)):
        assert_matches_single_device(got, full, what=f"gradients of call {i}")
