"""Optimizers optimizer parallel (hsdp) refuses: ``torch.optim.LBFGS``, ``torch.optim.Adafactor``.

LBFGS's step (with a closure) runs a line search that branches on dot products and norms of
all the parameters flattened; on shards each rank computed its own and took its own branch
(torch's simulated world raised 'Non Tensor or int rank results must be equal for all ranks';
a real job's ranks would have diverged silently). It is refused at the first call with a
TypeError naming the optimizer and the fix (data_parallel mode's optimizer parallel too);
without hsdp it trains as on one device.

Adafactor keeps row and column statistics of each whole parameter and scales its relative step
by the whole parameter's RMS: on shards its first step took them from the shard (wrong, each
rank its own), its second failed with a message blaming a checkpoint that was never loaded
(its ``row_var`` is not shaped like the shard). It is refused at the first call too, naming
its statistics and the fix; without hsdp it trains as on one device. An optimizer keeping
state in another shape than its parameter's is told so (not only that a checkpoint of
another layout was loaded).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def make_step(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss

        return opt.step(closure)

    return step


def lbfgs(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=3)


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_lbfgs_under_optimizer_parallel_is_refused(level: str) -> None:
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = lbfgs(net)
        parallel = sw.AutoParallel(make_step(net, opt), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        x, y = DATA[0]
        with pytest.raises(TypeError, match=r"LBFGS .* without hsdp\(\)"):
            parallel(world.rows(x), world.rows(y))


def test_lbfgs_under_data_parallel_modes_optimizer_parallel_is_refused() -> None:
    """``parallel_mode="data_parallel"`` with ``hsdp()`` (each rank updates the parameters it
    owns): refused too (torch's rank-results assertion before)."""
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = lbfgs(net)
        parallel = sw.AutoParallel(make_step(net, opt), parallel_mode="data_parallel").hsdp()
        x, y = DATA[0]
        with pytest.raises(TypeError, match=r"LBFGS .* without hsdp\(\)"):
            parallel(world.rows(x), world.rows(y))


def test_lbfgs_made_inside_the_step_is_refused_at_its_step() -> None:
    """One the step makes (not found at the first call) is refused at its first step."""
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return make_step(net, lbfgs(net))(x, y)

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto").hsdp(threshold=0)
        x, y = DATA[0]
        with pytest.raises(TypeError, match=r"LBFGS .* without hsdp\(\)"):
            parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize(
    ("level", "optimizer"),
    [("level1", "lbfgs"), ("level2", "lbfgs"), ("level3", "lbfgs"), ("level2", "adafactor")],
)
def test_a_closure_making_the_module_forms_first_call_is_refused(
    level: str, optimizer: str
) -> None:
    """The module form: the wrapper's first call inside ``opt.step(closure)`` (after the step's
    pre hooks ran, with no engine yet). Its first step ran unrefused before (a real job's
    weights off one device's by 1e-2; simulated ranks failed on a value differing between
    them); now the call raises the TypeError and no weight changed. The network then trains
    under a new wrapper and SGD as on one device."""
    ref = build()
    net = copy.deepcopy(ref)
    refused = r"LBFGS .* without hsdp\(\)" if optimizer == "lbfgs" else ADAFACTOR_REFUSED
    x, y = DATA[0]
    plain_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1))(x, y)
    with simulated_world(2) as world:
        world.replicate(net)
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt = lbfgs(net) if optimizer == "lbfgs" else adafactor(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(parallel(world.rows(x)), world.rows(y))
            loss.backward()
            return loss

        with pytest.raises(TypeError, match=refused):
            opt.step(closure)
        for name, p in net.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
        sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        again = sw.AutoParallel(net, parallel_mode="semi_auto")
        again.hsdp(threshold=0, optimizer_level=level)
        F.cross_entropy(again(world.rows(x)), world.rows(y)).backward()
        sgd.step()
        for name, p in net.named_parameters():  # (each rank: its half of dim 0)
            want = ref.get_parameter(name).detach().chunk(2)
            assert_matches_single_device(p.detach(), lambda r, w=want: w[r], what=name)


def trains_as_one_device(
    stepper: Callable[..., Callable[..., torch.Tensor]], optimizer: Callable[..., Any]
) -> None:
    """`stepper(net, optimizer(net))` without hsdp on 2 ranks: each loss and every parameter
    after equal one device's."""
    ref = build()
    net = copy.deepcopy(ref)
    step = stepper(ref, optimizer(ref))
    want = [step(x, y).detach() for x, y in DATA]
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, optimizer(net)), parallel_mode="semi_auto")
        for s, (x, y) in enumerate(DATA):
            got = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(got, want[s], what=f"loss {s}")
        for name, p in net.named_parameters():
            assert_matches_single_device(p.detach(), ref.get_parameter(name), what=name)


def test_lbfgs_without_optimizer_parallel_trains_as_one_device() -> None:
    trains_as_one_device(make_step, lbfgs)


def plain_step(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def adafactor(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(net.parameters(), lr=1e-2)


ADAFACTOR_REFUSED = r"torch.optim.Adafactor .*row and column statistics.*RMS.* without hsdp\(\)"


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_adafactor_under_optimizer_parallel_is_refused(level: str) -> None:
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = adafactor(net)
        parallel = sw.AutoParallel(plain_step(net, opt), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        x, y = DATA[0]
        with pytest.raises(TypeError, match=ADAFACTOR_REFUSED):
            parallel(world.rows(x), world.rows(y))
        assert not opt.state  # (no step ran)


def test_adafactor_in_the_module_form_is_refused_at_its_step() -> None:
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = adafactor(net)
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto").hsdp(threshold=0)
        x, y = DATA[0]
        F.cross_entropy(parallel(world.rows(x)), world.rows(y)).backward()
        with pytest.raises(TypeError, match=ADAFACTOR_REFUSED):
            opt.step()


def test_adafactor_without_optimizer_parallel_trains_as_one_device() -> None:
    trains_as_one_device(plain_step, adafactor)


class RowScaled(torch.optim.SGD):
    """SGD keeping a per-row statistic of each parameter (state shaped [rows, 1])."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    self.state[p]["rows"] = p.grad.pow(2).mean(1, keepdim=True)
        return out


def test_state_not_shaped_like_its_parameter_is_named_so() -> None:
    """Its second step finds state of another shape than the shard: the message says the
    optimizer keeps such state (it said only that a checkpoint of another layout was loaded)."""
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = RowScaled(net.parameters(), lr=0.1)
        parallel = sw.AutoParallel(plain_step(net, opt), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0)
        x, y = DATA[0]
        parallel(world.rows(x), world.rows(y))
        with pytest.raises(ValueError, match=r"'rows' .*not shaped like its parameter.*hsdp\(\)"):
            parallel(world.rows(x), world.rows(y))
