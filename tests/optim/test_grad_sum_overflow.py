"""Gradients divided by the world size before they are summed over the ranks (as DDP does).

Optimizer parallel (``hsdp()``, levels 1-3: ReduceScatter / AllReduce of each bucket) and
``parallel_mode="data_parallel"`` (the optimizer step pre-hook's AllReduce) summed the ranks'
gradients and divided the sum by the world size: a float16 gradient, or (hsdp) a
``GradScaler``'s scaled float32 one, overflowed to inf where one device's stays finite (the
scaler then skipped a step that one device takes). The reduced gradients now equal one
device's. So are semi_auto's gradients all-reduced one by one outside the fused buckets (after a
backward that raised). 4 simulated ranks, each on 2 of the 8 rows of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

WORLD = 4
MODES = ["level1", "level2", "level3", "data_parallel"]


def make(dtype: torch.dtype) -> nn.Linear:
    net = nn.Linear(64, 64, bias=False).to(dtype)
    with torch.no_grad():
        net.weight.fill_(0.01)
    return net


def wrap(step: Callable[..., torch.Tensor], mode: str) -> sw.AutoParallel:
    if mode == "data_parallel":
        return sw.AutoParallel(step, parallel_mode="data_parallel")
    parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
    return parallel.hsdp(threshold=0, optimizer_level=mode)


def rows_of(want: torch.Tensor, mode: str) -> Callable[[int], torch.Tensor]:
    """Rank r's part of a one-device weight's gradient: its dim-0 shard under hsdp."""
    if mode == "data_parallel":
        return lambda r: want
    return lambda r: want.chunk(WORLD)[r]


@pytest.mark.parametrize("mode", MODES)
def test_float16_gradients_sum_without_overflow(mode: str) -> None:
    """One device's gradient is 31248 per element (float16's largest finite value is 65504);
    each rank's is the same, and their sum before the division was inf."""
    x = torch.ones(8, 64, dtype=torch.float16)

    def step_of(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            (net(x).float().mean() * 2e6).backward()
            opt.step()  # (data_parallel averages at the step; level 1 reduces there)
            grad = net.weight.grad
            assert grad is not None
            out = grad.detach().clone()
            opt.zero_grad()
            return out

        return step

    one = make(torch.float16)
    want = step_of(one, torch.optim.SGD(one.parameters(), lr=1e-9))(x)
    assert torch.isfinite(want).all() and want.abs().max() > 30000
    net = make(torch.float16)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = wrap(step_of(net, torch.optim.SGD(net.parameters(), lr=1e-9)), mode)
        got = parallel(world.rows(x))
        assert_matches_single_device(got, rows_of(want, mode), what="weight gradient")


@pytest.mark.parametrize("mode", MODES[:3])
def test_a_grad_scaler_steps_where_one_device_steps(mode: str) -> None:
    """float32 at scale 1e38: each rank's scaled gradient is 0.94e38 (finite, as one device's),
    their sum past float32's largest value: the scaler found inf, skipped the step and halved
    its scale, where one device steps and doubles it. (``data_parallel``'s scaler checks each
    rank's own gradients, unscaled before the step averages them: it never overflowed.)"""
    x = torch.full((8, 64), 60.0)

    def step_of(net: nn.Module) -> tuple[Callable[..., torch.Tensor], torch.amp.GradScaler]:
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1e38, growth_interval=1)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.detach()

        return step, scaler

    one = make(torch.float32)
    step, one_scaler = step_of(one)
    step(x)
    assert one_scaler.get_scale() > 1e38  # (stepped, scale doubled: one device has no inf)
    net = make(torch.float32)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        step, scaler = step_of(net)
        parallel = wrap(step, mode)
        parallel(world.rows(x))
        assert scaler.get_scale() == one_scaler.get_scale()
        assert_matches_single_device(
            net.weight.detach(), rows_of(one.weight.detach(), mode), what="weight"
        )


def test_a_gradient_reduced_outside_the_buckets_sums_without_overflow() -> None:
    """semi_auto without hsdp: after a backward that raised (with one of the bucket's gradients
    in), the next backward's gradients are all-reduced one by one outside the buckets; they are
    divided first too (40000 per element on one device: their sum over 4 ranks was inf)."""
    x = torch.ones(8, 64, dtype=torch.float16)

    def pair() -> nn.Sequential:
        return nn.Sequential(make(torch.float16), make(torch.float16))

    def boom(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    one = pair()
    (one(x).float().mean() * 4e6).backward()
    want = [p.grad for p in one.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.max() > 30000 for g in want)
    net = pair()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)

        # (raising at the first layer's output: the second layer's gradient was in its bucket)
        def fail_there(m: nn.Module, i: object, out: torch.Tensor) -> None:
            out.register_hook(boom)

        hook = net[0].register_forward_hook(fail_there)
        bad = parallel(world.rows(x))
        hook.remove()
        good = parallel(world.rows(x))
        with pytest.raises(RuntimeError, match="boom"):
            (bad.float().mean() * 4e6).backward()
        net.zero_grad(set_to_none=True)
        (good.float().mean() * 4e6).backward()
        for p, g in zip(net.parameters(), want, strict=True):
            assert_matches_single_device(p.grad, g, what="weight gradient")


def two_layers(wide: bool = False) -> nn.Sequential:
    """Two linear layers; `wide`: no biases, a small first layer and a large second one, so
    that the hidden activation's gradient is larger than any parameter's (a bias's is the sum
    of the rows' gradients)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64, not wide), nn.Tanh(), nn.Linear(64, 64, not wide))
    if wide:
        with torch.no_grad():
            net[0].weight.mul_(0.1)
            net[2].weight.mul_(10.0)
    return net


HIDDEN_MODES = ["buckets", "level1", "level2", "level3"]


def hidden_run(
    net: nn.Sequential, mode: str, scaler: torch.amp.GradScaler | None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """A train step that records the hidden activation's gradient (`mode` is the caller's:
    how it wraps the step). With a `scaler`, the network runs under float16 autocast (float16
    activations and their gradients, float32 parameters)."""
    seen: list[torch.Tensor] = []
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def record(m: nn.Module, i: object, out: torch.Tensor) -> None:
        out.register_hook(seen.append)

    net[1].register_forward_hook(record)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = net(x).float().mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        return loss.detach()

    return step, seen


def wrap_hidden(step: Callable[..., torch.Tensor], mode: str) -> Callable[..., torch.Tensor]:
    parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
    return parallel if mode == "buckets" else parallel.hsdp(threshold=0, optimizer_level=mode)


@pytest.mark.parametrize("mode", HIDDEN_MODES)
def test_activation_gradients_inside_backward_are_one_devices(mode: str) -> None:
    """The gradient a hook sees on a hidden activation is one device's (this rank's rows of
    it), not the world size times it: shardwise seeds the train step's backward with 1/N rather
    than dividing the parameters' sums afterwards. Parameters after the step equal one
    device's."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    one = two_layers()
    step, seen = hidden_run(one, mode, None)
    step(x)
    want = seen.pop()
    net = two_layers()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        step, seen = hidden_run(net, mode, None)
        wrap_hidden(step, mode)(world.rows(x))
        got = seen.pop()
        assert_matches_single_device(
            got, lambda r: want.chunk(WORLD)[r], what="hidden gradient", rtol=1e-6
        )
        if mode == "buckets":
            for p, q in zip(net.parameters(), one.parameters(), strict=True):
                assert_matches_single_device(p.detach(), q.detach(), what="parameter")


@pytest.mark.parametrize("mode", HIDDEN_MODES)
def test_a_grad_scaler_near_overflow_inside_backward_steps_as_one_device(mode: str) -> None:
    """float16 autocast with a scale that puts one device's largest float16 activation gradient
    at 0.4 of float16's largest value: finite on one device (the scaler steps and doubles its
    scale). With the world size (4) times one device's activation gradients it was inf: the
    scaler skipped the step and halved its scale."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.01
    probe = two_layers(wide=True)
    hidden: list[torch.Tensor] = []

    def record(m: nn.Module, i: object, out: torch.Tensor) -> None:
        out.register_hook(hidden.append)

    probe[1].register_forward_hook(record)
    with torch.autocast("cpu", dtype=torch.float16):
        y = probe(x)
    y.float().mean().backward()
    largest = max(float(t.abs().max()) for t in [*hidden, *(p.grad for p in probe.parameters())])
    assert largest == float(hidden[0].abs().max())  # (x4 the hidden gradient overflows)
    scale = 0.4 * torch.finfo(torch.float16).max / largest
    one = two_layers(wide=True)
    one_scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1)
    hidden_run(one, mode, one_scaler)[0](x)
    assert one_scaler.get_scale() > scale  # (one device stepped and doubled it: no inf)
    net = two_layers(wide=True)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1)
        wrap_hidden(hidden_run(net, mode, scaler)[0], mode)(world.rows(x))
        assert scaler.get_scale() == one_scaler.get_scale()
        if mode == "buckets":
            for p, q in zip(net.parameters(), one.parameters(), strict=True):
                assert_matches_single_device(p.detach(), q.detach(), what="parameter")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_low_precision_loss_on_three_ranks_gives_one_devices_gradients(
    dtype: torch.dtype,
) -> None:
    """1/3 is not exact in float16 / bfloat16 (0.33325 / 0.33398): a seed of 1/3 in the loss's
    dtype biased every gradient by 2e-4 / 2e-3. Such a seed stays 1 and the gradients are
    divided by 3 in the buckets instead (as before the seeds were scaled)."""
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(12, 6, generator=g), torch.randn(12, 5, generator=g)

    def make() -> nn.Linear:
        torch.manual_seed(0)
        return nn.Linear(6, 5)

    def step_of(net: nn.Linear) -> Callable[..., torch.Tensor]:
        def step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(net(x), t).to(dtype)
            loss.backward()
            return loss.detach()

        return step

    one = make()
    step_of(one)(x, t)
    net = make()
    with simulated_world(3) as world:
        world.replicate(net)
        sw.AutoParallel(step_of(net))(world.rows(x), world.rows(t))
        for p, q in zip(net.parameters(), one.parameters(), strict=True):
            assert_matches_single_device(p.grad, q.grad, what="gradient")
