"""Parameters frozen or unfrozen, or given to the optimizer, between calls of a wrapped step.

The gradient buckets (semi_auto) and the data-parallel runner's plan are made for the
parameters that require gradients at the first call. A layer unfrozen later
(``requires_grad_(True)``, fine-tuning after a warm-up) had its gradient stepped unreduced on
each rank (each rank's copy drifting apart, silently); a parameter group added to the
optimizer later (``add_param_group``) likewise in ``parallel_mode="data_parallel"``. Both now
plan the buckets again at the next call; with optimizer parallel (hsdp), whose shards and
owners are planned once, such a change raises a ValueError naming the fix (a parameter frozen
later stays frozen there too: its gathered weight takes its requires_grad at each use; one
trainable at the first call, frozen and then unfrozen again, trains on: its buckets exist).
Also: keyword
inputs in ``parallel_mode="data_parallel"`` (they raised a TypeError naming an internal class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

STEPS = 3


def make(megatron: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    net[0].requires_grad_(False)
    if megatron:
        sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
        sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
    return net


g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]


def train(net: nn.Module, call: Callable[..., Any], change: Callable[[int], None]) -> list[Any]:
    out = []
    for i, (x, y) in enumerate(DATA):
        change(i)
        out.append(call(x, y))
    return out


def stepper(
    net: nn.Module, opt: torch.optim.Optimizer, first: Callable[[], None] = lambda: None
) -> Callable[..., torch.Tensor]:
    """A train step of `net` (`first`: run at the start of each call)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        first()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def unfreeze(net: nn.Module) -> Callable[[int], None]:
    def change(i: int) -> None:
        if i == 1:  # (after one step with the first layer frozen)
            net[0].requires_grad_(True)

    return change


@pytest.mark.parametrize(
    ("mode", "ranks", "megatron"),
    [("semi_auto", 2, False), ("data_parallel", 2, False), ("semi_auto", 4, True)],
)
def test_a_layer_unfrozen_between_steps_trains_as_one_device(
    mode: str, ranks: int, megatron: bool
) -> None:
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = train(ref, lambda x, y: stepper(ref, opt)(x, y).detach(), unfreeze(ref))
    net = make(megatron)
    with simulated_world(ranks) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        parallel = sw.AutoParallel(stepper(net, opt), parallel_mode=mode)
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)), unfreeze(net))
        for s in range(STEPS):
            assert_matches_single_device(got[s], want[s], what=f"loss {s}")
        plan = parallel.parallel_plan if mode == "semi_auto" else None
        for name, p in net.named_parameters():
            full = ref.get_parameter(name).detach()
            layout = plan.params[name].layout if plan is not None else None
            block = (
                full
                if layout is None
                else lambda r, f=full, lay=layout: f[lay.local_index(r, tuple(f.shape))]
            )
            assert_matches_single_device(p.detach(), block, what=name)
        if plan is not None:  # (the plan's buckets hold the unfrozen layer now)
            assert any("0.weight" in b.params for b in plan.buckets), plan.buckets


@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel"])
def test_unfrozen_under_optimizer_parallel_is_refused(mode: str) -> None:
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        parallel = sw.AutoParallel(stepper(net, opt), parallel_mode=mode)
        level = "level2" if mode == "semi_auto" else "level1"  # (data_parallel: its own only)
        parallel.hsdp(threshold=0, optimizer_level=level)
        x, y = DATA[0]
        parallel(world.rows(x), world.rows(y))
        net[0].requires_grad_(True)
        with pytest.raises(ValueError, match=r"before the first call"):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize("inside", [False, True], ids=["between calls", "inside the step"])
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_frozen_under_optimizer_parallel_stays_frozen(level: str, inside: bool) -> None:
    """Levels 1-2 keep each gathered weight past the step and gather into it again: a weight
    frozen since (``requires_grad_(False)``) kept its gradient and was still updated. Frozen
    inside the step, the call reached the gathered weight, not the parameter: at the next
    gather the weight was made trainable again (every level; `_node_run.ON_PARAMETER`)."""
    calls = [0]

    def freeze_inside(net: nn.Module) -> Callable[[], None]:
        def first() -> None:
            if inside and calls[0] % STEPS == 1:
                net[2].weight.requires_grad_(False)
            calls[0] += 1

        return first

    def freeze(net: nn.Module) -> Callable[[int], None]:
        def change(i: int) -> None:
            if i == 1 and not inside:
                net[2].weight.requires_grad_(False)

        return change

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))  # (both rows shard)

    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    one = stepper(ref, opt, freeze_inside(ref))
    want = train(ref, lambda x, y: one(x, y).detach(), freeze(ref))
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = stepper(net, opt, freeze_inside(net))
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)), freeze(net))
        for s in range(STEPS):
            assert_matches_single_device(got[s], want[s], what=f"loss {s}")
        assert not net[2].weight.requires_grad


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_frozen_then_unfrozen_under_optimizer_parallel_trains_as_one_device(level: str) -> None:
    """A weight trainable at the first call, frozen for the second and trainable again for the
    third: its shards and buckets were planned at the first call, so it trains on as on one
    device. It was refused, the message saying it did not require a gradient at the first
    call (the check compared against the previous call's parameters, not the first's)."""

    def flip(net: nn.Module) -> Callable[[int], None]:
        def change(i: int) -> None:
            net[2].weight.requires_grad_(i != 1)  # (trainable, frozen, trainable again)

        return change

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))  # (every row shards)

    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = train(ref, lambda x, y: stepper(ref, opt)(x, y).detach(), flip(ref))
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        parallel = sw.AutoParallel(stepper(net, opt), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)), flip(net))
        for s in range(STEPS):
            assert_matches_single_device(got[s], want[s], what=f"loss {s}")
        shards = parallel.optimizer_plan
        assert shards is not None
        for name, p in net.named_parameters():
            assert shards.param(name).sharded, name
            full = ref.get_parameter(name).detach()
            rows = lambda r, f=full: f.chunk(2)[r]  # noqa: E731
            assert_matches_single_device(p.detach(), rows, what=name)


def _flip_in_step(
    level: str | None, flips: dict[tuple[int, str], bool], module: int = 0
) -> tuple[list[Any], list[Any], nn.Module, nn.Module, Any]:
    """Train one device and 2 simulated ranks (hsdp at `level`, None: without) with
    ``net[module].requires_grad_(flag)`` for each ``(call, where): flag`` of `flips` (where:
    ``"between"`` calls, at the step's ``"start"``, ``"mid"`` forward); both losses, both
    networks and the parallel step."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)  # (every row shards)
        layers = [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)]
        return nn.Sequential(*layers)

    def run(net: nn.Sequential, call: Callable[..., Any]) -> list[Any]:
        now = [0]  # (the call: the step may run more than once per call, first on fakes)

        def flip(where: str, i: int) -> None:
            if (i, where) in flips:
                net[module].requires_grad_(flips[(i, where)])

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            i = now[0]
            flip("start", i)
            h = net[1](net[0](x))
            flip("mid", i)
            loss = F.cross_entropy(net[2:](h), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        out = []
        for i, (x, y) in enumerate(DATA):
            now[0] = i
            flip("between", i)
            out.append(call(step, x, y))
        return out

    ref, net = build(), build()
    want = run(ref, lambda step, x, y: step(x, y).detach())
    with simulated_world(2) as world:
        world.replicate(net)
        made: list[Any] = []

        def call(step: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> Any:
            if not made:
                made.append(sw.AutoParallel(step, parallel_mode="semi_auto"))
                if level is not None:
                    made[0].hsdp(threshold=0, optimizer_level=level)
            return made[0](world.rows(x), world.rows(y))

        got = run(net, call)
        return want, got, ref, net, made[0]


@pytest.mark.parametrize("level", ["level1", "level2", "level3", None])
@pytest.mark.parametrize(
    "flips",
    [{(1, "start"): False}, {(1, "between"): False, (2, "start"): True}],
    ids=["frozen", "unfrozen again"],
)
def test_a_layer_frozen_or_unfrozen_inside_the_step_before_its_forward(
    level: str | None, flips: dict[tuple[int, str], bool]
) -> None:
    """``net[0].requires_grad_(False)`` inside the step before its forward (freezing a
    backbone after N steps) is what it is between calls. With hsdp it raised torch's 'mat1
    and mat2 shapes cannot be multiplied': the capture recorded the call as a node, whose
    output the first layer then read instead of the parameter, so the layer computed with
    this rank's shard of its weight. A layer frozen since an earlier call and unfrozen inside
    the step trains again."""
    want, got, ref, net, parallel = _flip_in_step(level, flips)
    for s in range(STEPS):
        assert_matches_single_device(got[s], want[s], what=f"loss {s}")
    plan = parallel.optimizer_plan
    for name, p in net.named_parameters():
        full = ref.get_parameter(name).detach()
        sharded = plan is not None and plan.param(name).sharded
        rows = (lambda r, f=full: f.chunk(2)[r]) if sharded else full
        assert_matches_single_device(p.detach(), rows, what=name)
    frozen = () if (2, "start") in flips else ("0.weight", "0.bias")
    assert parallel.parallel_plan.frozen == frozen


@pytest.mark.parametrize("level", ["level1", None])
def test_a_layer_frozen_after_the_forward_started_is_refused(level: str | None) -> None:
    """Between the forward's first op and the backward the gradients are planned and the
    weights gathered already: a ValueError names the parameter and the fix (the change was
    planned as a node of the step; the layer trained on, silently)."""
    with pytest.raises(ValueError, match=r"'2.weight' is frozen .* at the start of the step"):
        _flip_in_step(level, {(1, "mid"): False}, module=2)


@pytest.mark.parametrize("level", ["level2", None])
def test_a_layer_unfrozen_inside_the_step_that_was_frozen_at_the_first_call(
    level: str | None,
) -> None:
    """Unfrozen inside the step, a layer frozen at the first call is refused with hsdp (its
    shards and buckets were planned then), as between calls, and trains without it."""
    flips = {(0, "between"): False, (1, "start"): True}
    if level is not None:
        with pytest.raises(ValueError, match=r"'0.weight'.*before the first call"):
            _flip_in_step(level, flips)
        return
    want, got, *_ = _flip_in_step(level, flips)
    for s in range(STEPS):
        assert_matches_single_device(got[s], want[s], what=f"loss {s}")


def test_a_parameter_group_added_later_in_the_data_parallel_mode() -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        return net, torch.optim.SGD(net[2].parameters(), lr=0.1)

    def add(opt: torch.optim.Optimizer, net: nn.Module) -> Callable[[int], None]:
        def change(i: int) -> None:
            if i == 1:
                opt.add_param_group({"params": list(net[0].parameters()), "lr": 0.05})

        return change

    ref, opt = build()
    want = train(ref, lambda x, y: stepper(ref, opt)(x, y).detach(), add(opt, ref))
    net = build()[0]
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net[2].parameters(), lr=0.1)
        parallel = sw.AutoParallel(stepper(net, opt), parallel_mode="data_parallel")
        got = train(net, lambda x, y: parallel(world.rows(x), world.rows(y)), add(opt, net))
        for s in range(STEPS):
            assert_matches_single_device(got[s], want[s], what=f"loss {s}")
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), ref.get_parameter(name), what=name)


@pytest.mark.parametrize("strategy", ["data_parallel", "full_batch"])
def test_keyword_inputs_in_the_data_parallel_mode(strategy: str) -> None:
    net = make()
    x, y = DATA[0]
    want = F.cross_entropy(net(x), y).detach()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(inputs: torch.Tensor, *, labels: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(inputs), labels)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="data_parallel").dataset_strategy(strategy)
        give = world.rows if strategy == "data_parallel" else world.same
        got = parallel(inputs=give(x), labels=give(y))
        assert_matches_single_device(got, want, what="loss")
    other, want_out = make(), make()(x).detach()
    with simulated_world(2) as world:
        world.replicate(other)
        module = sw.AutoParallel(other, parallel_mode="data_parallel")
        out = module(input=world.rows(x))
        assert_matches_single_device(out.detach(), world.rows(want_out), what="output")


def test_a_layer_unfrozen_inside_the_train_step_in_the_data_parallel_mode() -> None:
    """``requires_grad_`` inside the step (unfreeze the backbone at step N): the plan is
    checked again at the optimizer's step, so the unfrozen weight's gradient is averaged (it
    was checked at the call's start only: each rank stepped its own rows' gradient)."""

    def body(net: nn.Module, opt: torch.optim.Optimizer, i: int) -> Callable[..., Any]:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            net[0].requires_grad_(i != 1)  # (trainable, frozen, trainable again)
            return stepper(net, opt)(x, y)

        return step

    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = [body(ref, opt, i)(x, y).detach() for i, (x, y) in enumerate(DATA)]
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        calls = iter(range(STEPS))
        parallel = sw.AutoParallel(
            lambda x, y: body(net, opt, next(calls))(x, y), parallel_mode="data_parallel"
        )
        for s, (x, y) in enumerate(DATA):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got, want[s], what=f"loss {s}")
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), ref.get_parameter(name).detach(), what=name)
