"""parallel_mode="data_parallel" averages the gradients in the step of the optimizers the wrapper
knows (or takes at their first step): a train step that changes the weights otherwise (a
hand-written update) used each rank's own gradient; it is refused with a ValueError naming the
parameter and the fix. A step that only accumulates gradients, or evaluates, before its first
optimizer step is not. An optimizer swapped in mid-training (or built anew in each call) over
all the parameters of known optimizers replaces them (it was refused as 'built anew'); one over
only some of a known optimizer's parameters, or any swap with hsdp(), is a ValueError naming
the fix. 2 simulated ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise.optim import DataParallelRunner
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


g = torch.Generator().manual_seed(2)
DATA = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]


def test_weights_changed_without_an_optimizer_step_are_refused() -> None:
    net, (x, y) = make_net(), batch()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(0.1 * p.grad)  # type: ignore[operator]
            return loss

        run = AutoParallel(step, parallel_mode="data_parallel")
        with pytest.raises(ValueError, match=r"changed parameter '0\.weight' without a step") as e:
            run(world.rows(x), world.rows(y))
    assert "Build the optimizer before the wrapper" in str(e.value)


def swapped(net: nn.Module, call: Any, opts: list[torch.optim.Optimizer]) -> list[Any]:
    """Train on `DATA` through `call(step, x, y)` with the optimizers in `opts` (the step reads
    the list each call): optimizers[0] swapped for a new SGD at call 2 (optimizers[1] keeps
    training), both for one Adam over all the parameters at call 4."""
    assert isinstance(net, nn.Sequential)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        return loss

    out = []
    for i, (x, y) in enumerate(DATA):
        if i == 2:
            opts[0] = torch.optim.SGD(net[0].parameters(), lr=0.03, momentum=0.9)
        if i == 4:
            opts[:] = [torch.optim.Adam(net.parameters(), lr=0.01)]
        out.append(call(step, x, y))
    return out


def first_optimizers(net: nn.Sequential) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SGD(net[0].parameters(), lr=0.05, momentum=0.9),
        torch.optim.SGD(net[2].parameters(), lr=0.05, momentum=0.9),
    ]


def params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in net.named_parameters()}


class WithLoss(nn.Module):
    """The network and its loss (the module form returns it averaged over the ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


def module_form_matches_one_device(train: Any) -> None:
    """`train(net, forward, rows)` of a `WithLoss` on one device, and of another wrapped in
    data_parallel mode on 2 simulated ranks: the same losses and parameters."""
    ref = WithLoss()
    want = train(ref, ref, lambda t: t)
    net = WithLoss()
    with simulated_world(2) as world:
        world.replicate(net)
        got = train(net, AutoParallel(net, parallel_mode="data_parallel"), world.rows)
        assert_matches_single_device(got, want, what="losses")
        assert_matches_single_device(params(net), params(ref), what="parameters")


def test_optimizers_swapped_mid_training_replace_the_known_ones() -> None:
    """Train-step form: the optimizers passed are replaced mid-training, one (its neighbour
    keeps its hooks) then both by one (a new one's first step raised 'built anew')."""
    ref = make_net()
    want = swapped(ref, lambda step, x, y: step(x, y).detach(), first_optimizers(ref))
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        opts = first_optimizers(net)  # type: ignore[arg-type]
        parallel: list[Any] = []

        def call(step: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            if not parallel:
                parallel.append(AutoParallel(step, parallel_mode="data_parallel", optimizer=opts))
            return parallel[0](world.rows(x), world.rows(y))

        got = swapped(net, call, opts)
        assert_matches_single_device(got, want, what="losses")
        assert_matches_single_device(params(net), params(ref), what="parameters")


def test_module_form_optimizer_swapped_mid_training_matches_one_device() -> None:
    """Module form: the optimizer built after the wrapper (taken at its first step), then an
    Adam swapped in at call 3, trains as one device."""

    def train(net: nn.Module, forward: Any, rows: Any) -> list[torch.Tensor]:
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        out = []
        for i, (x, y) in enumerate(DATA):
            if i == 3:
                opt = torch.optim.Adam(net.parameters(), lr=0.01)
            loss = forward(rows(x), rows(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return out

    module_form_matches_one_device(train)


def test_an_optimizer_built_anew_in_each_call_replaces_the_last_one() -> None:
    """An optimizer built inside the step (a new one each call) was refused from the second
    call; each now replaces the last: one device's update every call, one known optimizer
    and the same collectives per call throughout."""

    def step_of(net: nn.Module) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            torch.optim.SGD(net.parameters(), lr=0.1).step()
            net.zero_grad()
            return loss

        return step

    ref = make_net()
    want = [step_of(ref)(x, y).detach() for x, y in DATA]
    net = make_net()
    with simulated_world(2) as world, CommRecorder() as rec:
        world.replicate(net)
        runner = DataParallelRunner(net, [], train_step=step_of(net))
        got, counts = [], []
        for x, y in DATA:
            before = rec.count("AllReduce")
            got.append(runner(world.rows(x), world.rows(y)))
            counts.append(rec.count("AllReduce") - before)
            assert len(runner.optimizers) == 1
        assert counts == [runner.collectives_per_step()["AllReduce"]] * len(DATA)
        assert_matches_single_device(got, want, what="losses")
        assert_matches_single_device(params(net), params(ref), what="parameters")


def test_two_optimizers_alternating_over_the_same_parameters_match_one_device() -> None:
    """Two optimizers over the same parameters stepped in turn: each replaces the other."""

    def train(net: nn.Module, forward: Any, rows: Any) -> list[torch.Tensor]:
        pair = [
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(net.parameters(), lr=0.02),
        ]
        out = []
        for i, (x, y) in enumerate(DATA):
            loss = forward(rows(x), rows(y))
            loss.backward()
            pair[i % 2].step()
            net.zero_grad()
            out.append(loss.detach())
        return out

    module_form_matches_one_device(train)


def boxed_step(net: nn.Module, box: list[torch.optim.Optimizer]) -> Any:
    """A train step of `net` stepping the optimizer in ``box[0]`` (replaced between calls)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        box[0].step()
        box[0].zero_grad()
        return loss

    return step


def step_form_matches_one_device(train: Any, given: Any) -> None:
    """`train(net, call, rows)` of `make_net()` on one device (`call(step, opts)` the step
    itself), and of another whose step is wrapped in data_parallel mode on 2 simulated ranks
    with ``optimizer=given(opts)``: the same losses and parameters."""
    ref = make_net()
    want = train(ref, lambda step, opts: step, lambda t: t)
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        got = train(
            net,
            lambda step, opts: AutoParallel(
                step, parallel_mode="data_parallel", optimizer=given(opts)
            ),
            world.rows,
        )
        assert_matches_single_device(got, want, what="losses")
        assert_matches_single_device(params(net), params(ref), what="parameters")


@pytest.mark.parametrize("passed", [False, True, "reversed"])
def test_warm_up_then_another_optimizer_both_known_from_the_start(passed: bool | str) -> None:
    """SGD for two calls, then Adam over the same parameters, both built before the wrapper and
    named in the train step (or both passed): was a ValueError at the first call (a parameter
    held by two optimizers); the second is taken when it first steps."""

    def train(net: nn.Module, call: Any, rows: Any) -> list[torch.Tensor]:
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        adam = torch.optim.Adam(net.parameters(), lr=0.01)
        seen = [0]

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            (sgd if seen[0] < 2 else adam).step()
            net.zero_grad()
            seen[0] += 1
            return loss

        run = call(step, [adam, sgd] if passed == "reversed" else [sgd, adam])
        return [run(rows(x), rows(y)).detach() for x, y in DATA]

    step_form_matches_one_device(train, lambda opts: opts if passed else None)


def test_a_new_optimizer_over_the_parameters_left_trainable_replaces_the_known_one() -> None:
    """Fine-tuning: the first layer frozen at call 2 and a new SGD built over the parameters
    still requiring gradients (was refused as holding only some of the known one's)."""

    def train(net: nn.Module, call: Any, rows: Any) -> list[torch.Tensor]:
        box = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]

        step = boxed_step(net, box)

        run = call(step, box[0])
        out = []
        for i, (x, y) in enumerate(DATA):
            if i == 2:
                net[0].requires_grad_(False)  # type: ignore[index]
                box[0] = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], 0.05)
            out.append(run(rows(x), rows(y)).detach())
        return out

    step_form_matches_one_device(train, lambda opt: opt)


@pytest.mark.parametrize("hsdp", [False, True])
def test_a_new_optimizer_over_part_of_a_known_ones_parameters_is_refused(hsdp: bool) -> None:
    """A new optimizer over the first layer only, the known one holding all the parameters:
    which one trains the rest is ambiguous, a ValueError naming the case and the fix; with
    hsdp() (owners planned once) any swap is, naming semi_auto's hsdp."""
    x, y = DATA[0]
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        box = [torch.optim.SGD(net.parameters(), lr=0.1)]

        step = boxed_step(net, box)

        parallel = AutoParallel(step, parallel_mode="data_parallel", optimizer=box[0])
        if hsdp:
            parallel.hsdp(threshold=0)
        parallel(world.rows(x), world.rows(y))
        box[0] = torch.optim.SGD(net[0].parameters(), lr=0.1)  # type: ignore[index]
        want = r"planned once.*semi_auto' with hsdp\(\)" if hsdp else r"steps 2 of the 4 param"
        with pytest.raises(ValueError, match=want) as e:
            parallel(world.rows(x), world.rows(y))
    if not hsdp:
        assert "build a new optimizer over all the parameters of the one it replaces" in str(
            e.value
        )


def test_accumulating_and_evaluating_first_then_stepping_match_one_device() -> None:
    x, y = batch()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor, how: str) -> torch.Tensor:
        if how == "eval":
            with torch.no_grad():
                return nn.functional.cross_entropy(net(x), y)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if how == "step":
            opt.step()
            opt.zero_grad()
        return loss

    calls = ["eval", "accumulate", "step", "eval", "step", "eval"]
    want = [float(step(x, y, how).detach()) for how in calls]
    net = make_net()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        run: Any = AutoParallel(step, parallel_mode="data_parallel")
        got = [float(world.local(run(world.rows(x), world.rows(y), how), 0)) for how in calls]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


class _Lookahead(torch.optim.Optimizer):
    """A wrapper optimizer (as Lookahead, Accelerate's AcceleratedOptimizer): its step runs
    an inner optimizer over the same parameter groups, then moves slow weights toward them."""

    def __init__(self, inner: torch.optim.Optimizer, alpha: float = 0.5) -> None:
        self.inner, self.alpha = inner, alpha
        self.slow = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        super().__init__(inner.param_groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()
        params = [p for g in self.inner.param_groups for p in g["params"]]
        for p, s in zip(params, self.slow, strict=True):
            s.add_(p - s, alpha=self.alpha)
            p.copy_(s)


def test_a_wrapper_optimizers_inner_step_is_left_alone() -> None:
    """The module form takes the wrapper at its first step; the inner optimizer it steps, over
    the same parameters, is not refused as 'built anew' (the outer step averaged)."""
    net, (x, y) = make_net(), batch()
    ref = make_net()
    opt = _Lookahead(torch.optim.SGD(ref.parameters(), lr=0.1))
    for _ in range(2):
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = AutoParallel(net, parallel_mode="data_parallel")
        opt = _Lookahead(torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(2):
            nn.functional.cross_entropy(parallel(world.rows(x)), world.rows(y)).backward()
            opt.step()
            opt.zero_grad()
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
        )


def test_a_scalar_the_step_makes_comes_back_as_made() -> None:
    """A step returning a scalar it made (the scheduler's learning rate as a tensor): the mode
    averages returned scalars over the ranks, and a value every rank made alike comes back as
    made (a simulated world summed it once, not once a rank: it came back divided by the world
    size)."""
    net, (x, y) = make_net(), batch()
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss, torch.tensor(sched.get_last_lr()[0])

        run = AutoParallel(step, parallel_mode="data_parallel")
        for want in (0.05, 0.025):
            _, lr = run(world.rows(x), world.rows(y))
            assert_matches_single_device(lr, torch.tensor(want))
