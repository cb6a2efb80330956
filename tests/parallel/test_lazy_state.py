"""State a train step creates lazily on its first call, made during the capture.

The capture runs the step on fake tensors. Before, what the step created lazily there stayed
fake for every later call: ``torch.amp.GradScaler`` creates its scale in its first
``scaler.scale(loss)``, so training under fp16 autocast used a fake scale (losses 0.0807 and
0.0884 at steps 2 and 3 against one device's 0.0758 and 0.0805, silently; ``get_scale()``
failed); a module that caches a tensor on itself in ``forward`` kept a fake one. The capture now
puts such attributes back (`planner/_user_state.kept_real`), so the first real call creates
them as one device does.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world


def make() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def scaled_step(
    net: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("megatron", [False, True])
def test_a_grad_scaler_made_on_the_first_call_trains_as_one_device(megatron: bool) -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 8, generator=g) for _ in range(3)]
    single = make()
    run = scaled_step(
        single, torch.optim.SGD(single.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    )
    want = [run(x).detach() for x in xs]
    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        if megatron:
            sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
            sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
        scaler = torch.amp.GradScaler("cpu")
        step = scaled_step(net, torch.optim.SGD(net.parameters(), lr=0.1), scaler)
        parallel = sw.AutoParallel(step)
        for i, x in enumerate(xs):
            loss = parallel(world.rows(x))
            # (float16 matmuls summed in another order on the ranks)
            assert_matches_single_device(loss, want[i], rtol=1e-3, what=f"loss {i}")
        assert scaler.get_scale() == 2.0**16  # (a real scale, as one device's)


class CachesAMask(nn.Module):
    """Makes a mask on its first forward and keeps it, as an attribute or as a buffer."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = nn.Linear(8, 8), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "mask"):
            mask = torch.arange(8.0) % 2
            if self.how == "buffer":
                self.register_buffer("mask", mask)
            else:
                self.mask = mask
        out: torch.Tensor = self.lin(x) * self.mask
        return out


@pytest.mark.parametrize("how", ["attribute", "buffer"])
def test_a_tensor_a_module_caches_in_forward_is_real(how: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, generator=g)
    torch.manual_seed(0)
    single = CachesAMask(how)
    want = [single(x).pow(2).mean() for _ in range(2)]
    torch.manual_seed(0)
    net = CachesAMask(how)
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).pow(2).mean()
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        for i in range(2):
            assert_matches_single_device(parallel(world.rows(x)), want[i], what=f"loss {i}")
        assert_matches_single_device(net.mask, torch.arange(8.0) % 2, what="the cached mask")


TOTAL = torch.zeros(())  # (`global TOTAL` in a step)


def metric_step(net: nn.Module, how: str) -> Callable[..., torch.Tensor]:
    """A step that keeps a running count of correct rows in `how`: a dict's value, a list's
    item, a global, a closure's variable (``nonlocal``); all updated before ``backward``, so
    the plan counts over the global batch."""
    stats = {"correct": torch.zeros(())}
    seen = [torch.zeros(())]
    count = torch.zeros(())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        global TOTAL
        nonlocal count
        out = net(x)
        right = (out.argmax(1) == y).sum()
        if how == "dict":
            stats["correct"] = stats["correct"] + right
        elif how == "list":
            seen[0] = seen[0] + right
        elif how == "global":
            TOTAL = TOTAL + right
        else:
            count = count + right
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss

    def read() -> torch.Tensor:
        return {"dict": stats["correct"], "list": seen[0], "global": TOTAL}.get(how, count)

    step.read = read  # type: ignore[attr-defined]
    return step


@pytest.mark.parametrize("how", ["dict", "list", "global", "nonlocal"])
def test_a_running_metric_the_step_keeps_is_real(how: str) -> None:
    """Before, the capture left a fake tensor in the dict (list, global, cell): every later
    call added to it, and reading it raised ``DataDependentOutputException`` far from the
    cause."""
    global TOTAL
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 8, (8,), generator=g))]
    batches *= 3
    TOTAL = torch.zeros(())
    single = metric_step(make(), how)
    for x, y in batches:
        single(x, y)
    want = single.read().clone()  # type: ignore[attr-defined]
    TOTAL = torch.zeros(())
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        step = metric_step(net, how)
        parallel = sw.AutoParallel(step)
        for x, y in batches:
            parallel(world.rows(x), world.rows(y))
        got = step.read()  # type: ignore[attr-defined]
        assert_matches_single_device(got, want, what=f"running count in a {how}")
        assert int(want) > 0


class Cycle:
    """A schedule the step advances itself: the weight of call t is ``W[t % 2]``."""

    W = (1.0, 3.0)

    def __init__(self) -> None:
        self.t = 0
        self.ring = [torch.tensor(10.0), torch.tensor(11.0), torch.tensor(12.0)]
        self.stats: dict[str, list[torch.Tensor]] = {"hist": []}

    def step_of(self, net: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w = self.W[self.t % 2]
            self.t += 1
            loss = ((net(x) - y) ** 2 * w).mean()
            self.ring.pop(0)  # (a ring of the last three losses, shifted each call)
            self.ring.append(loss.detach())
            self.stats["hist"].append(loss.detach())  # (a list inside a dict)
            smooth = torch.stack(self.ring).mean()
            loss.backward()
            return loss, smooth

        return step


def test_the_capture_does_not_advance_the_steps_python_state() -> None:
    """The capture ran the step once before the first real call: a counter it advanced put
    every call one step ahead (and a value noted as a local size's where the cycle repeated:
    3.0 turned into 1.0 on calls 0, 2, ...), a ring of losses shifted one place too far
    (``[12, 12, l0]``), a list inside a dict kept the capture's fake tensor."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    one, many = Cycle(), Cycle()
    single = make()
    step = one.step_of(single)
    want = [tuple(t.detach() for t in step(x, y)) for _ in range(4)]
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(many.step_of(net))
        for call, (loss, smooth) in enumerate(want):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got[0], loss, what=f"loss of call {call}")
            assert_matches_single_device(got[1], smooth, what=f"smoothed loss of call {call}")
        assert many.t == one.t == 4
        assert len(many.stats["hist"]) == 4
        for got_t, want_t in zip(many.stats["hist"], one.stats["hist"], strict=True):
            assert_matches_single_device(got_t, want_t, what="a loss kept in a list in a dict")


class Branching:
    """A trainer whose step counter turns on an extra op every second call (lazy
    regularization's pattern), and draws a loss weight from its own generators."""

    def __init__(self, net: nn.Module) -> None:
        self.net, self.t = net, 0
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)
        self.rng = random.Random(5)
        self.np_rng = np.random.default_rng(5)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.t += 1
        w = self.rng.choice([1.0, 3.0]) * float(self.np_rng.choice([1.0, 0.5]))
        h = self.net(x)
        if self.t % 2 == 0:
            h = h * 2.0 + 1.0
        loss = ((h - y) ** 2).mean() * w
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


def test_a_call_planned_again_part_way_runs_from_the_state_it_started_in() -> None:
    """The second call takes the other branch: it stops part way, is planned again and run
    anew. Its counter was advanced twice (``t`` 7 after 4 calls, the branch then on the wrong
    calls: loss 1.134 against 1.863), and the generator objects' draws (a ``random.Random``,
    NumPy's ``Generator``, state outside their ``__dict__``) were one call ahead."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(4)]
    one = Branching(make())
    want = [one.step(x, y).detach() for x, y in data]
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        trainer = Branching(net)
        parallel = sw.AutoParallel(trainer.step)
        for call, (x, y) in enumerate(data):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got, want[call], what=f"loss of call {call}")
        assert trainer.t == one.t == 4


BIG = list(range(300_000))  # (a large global the step reads: its items fill the snapshot)


def test_a_large_global_leaves_the_steps_own_lists_noted() -> None:
    """A list the step appends to was left holding the capture's fake tensor once a large
    global had used up the snapshot's item budget (its own list was not noted)."""
    history: list[torch.Tensor] = []
    net = make()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    with simulated_world(2) as world:
        world.replicate(net)

        def step(a: torch.Tensor) -> torch.Tensor:
            loss = net(a).pow(2).mean() * (1 + BIG[-1] * 0)
            history.append(loss.detach())
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        for _ in range(2):
            parallel(world.rows(x))
        assert len(history) == 2
        assert_matches_single_device(torch.stack(history).mean(), history[0], what="history")


class Keeper:
    """An object whose bound method is a forward hook keeping the layer's outputs."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def hook(self, module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        self.kept.append(out.detach())


@pytest.mark.parametrize("how", ["closure", "pre-hook", "method", "global"])
def test_a_hook_that_keeps_outputs_keeps_real_ones(how: str) -> None:
    """A forward hook (pre-hook, bound-method hook, hook registered for all modules) appending
    to a list it closes over left the capture's fake tensor first in that list: reading it
    raised ``DataDependentOutputException``, and each new input shape added another. Each rank
    keeps its own rows of the batch (the plan splits it)."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(6))
    want = make()[0](x).detach()
    net, keeper = make(), Keeper()
    kept = keeper.kept
    first = net[0]

    def keep(module: nn.Module, args: tuple[torch.Tensor], *out: torch.Tensor) -> None:
        if module is first:
            kept.append((out[0] if out else args[0]).detach())

    if how == "closure":
        handle = first.register_forward_hook(keep)
    elif how == "pre-hook":
        handle = first.register_forward_pre_hook(keep)
        want = x
    elif how == "method":
        handle = first.register_forward_hook(keeper.hook)
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(keep)
    try:
        with torch.no_grad(), simulated_world(2) as world:
            world.replicate(net)
            parallel = sw.AutoParallel(net)
            for _ in range(2):
                parallel(world.rows(x))
            assert len(kept) == 2, f"the hook's list holds {[type(t).__name__ for t in kept]}"
            for got in kept:
                assert_matches_single_device(got, world.rows(want), what=f"what a {how} hook kept")
    finally:
        handle.remove()
