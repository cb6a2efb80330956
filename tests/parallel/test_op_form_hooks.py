"""``sw.shard``'s op form on an ``nn.Linear`` that also has hooks.

A module's forward pre-hooks (with or without kwargs, ``torch.nn.utils.weight_norm``'s
recomputation of the weight) and full backward hooks (torch wraps the module's inputs for
them) run inside the module's call. The capture gave the op form to the first call made
there, the hook's, and refused the Linear's own call as a second one (a CaptureError blaming
``F.linear``). Now the hooks' calls are planned as ordinary ops and the strategy goes to the
Linear's call: loss and gradients equal one device's on 2 ranks, and the plan's node for the
Linear has the user's strategy. A forward whose own second call breaks the op form is still
refused, naming both calls.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (fc1's)
RANKS = 2
COLUMN = ((1, 1), (2, 1))  # fc1: column parallel (the weight's rows split)
ROW = ((1, 2), (1, 2))  # fc2: row parallel (the input's features split)


def _double(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 2.0,)


def _shift(m: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return (args[0] - 0.5,), kw


def _halve_input_grad(m: nn.Module, gi: Any, go: Any) -> tuple[Any, ...] | None:
    return None if gi[0] is None else (gi[0] * 0.5,)  # (fc1's input needs no gradient)


def _triple_output_grad(m: nn.Module, go: Any) -> tuple[Any, ...]:
    return (go[0] * 3.0,)


def _plus_one(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out + 1.0


def _weight_norm(m: nn.Module) -> None:
    with warnings.catch_warnings():  # (deprecated in favour of the parametrization)
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(m)


HOOKS = {
    "forward pre-hook": lambda m: m.register_forward_pre_hook(_double),
    "forward pre-hook with kwargs": lambda m: m.register_forward_pre_hook(_shift, with_kwargs=True),
    "full backward hook": lambda m: m.register_full_backward_hook(_halve_input_grad),
    "full backward pre-hook": lambda m: m.register_full_backward_pre_hook(_triple_output_grad),
    "forward hook": lambda m: m.register_forward_hook(_plus_one),
    "old weight_norm": _weight_norm,
}


class Net(nn.Module):
    def __init__(self, hook: str, on: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        HOOKS[hook](getattr(self, on))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


g = torch.Generator().manual_seed(1)
X, Y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("on", ["fc1", "fc2"])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_on_an_op_form_linear_train_as_one_device(hook: str, on: str) -> None:
    ref = Net(hook, on)
    want = F.cross_entropy(ref(X), Y)
    want.backward()
    net = Net(hook, on)
    sw.shard(net.fc1, in_strategy=COLUMN)
    sw.shard(net.fc2, in_strategy=ROW)
    with simulated_world(RANKS) as world:
        world.replicate(net)
        grads: dict[str, torch.Tensor] = {}

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            grads.update({n: p.grad for n, p in net.named_parameters()})
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="semi_auto", network=net)
        loss = parallel(world.rows(X), world.rows(Y))
        assert_matches_single_device(loss, want.detach(), what="loss")
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in ref.named_parameters():
            layout, full = plan.params[name].layout, p.grad
            assert full is not None

            def block(r: int, f: torch.Tensor = full, a: Any = layout) -> torch.Tensor:
                return f[a.local_slice(r, tuple(f.shape))]

            assert_matches_single_device(grads[name], block, what=name)
        linears = {n.name: n for n in plan.nodes if n.op == "torch.nn.functional.linear"}
        assert linears["fc1/linear"].rule == linears["fc2/linear"].rule == "user"
        strategies = parallel.strategies()
        assert strategies["fc1/linear"][:2] == COLUMN
        assert strategies["fc2/linear"][:2] == ROW


class TwoCalls(nn.Linear):
    """An ``nn.Linear`` whose forward makes a second torch call, with a forward pre-hook."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 2


def test_a_second_call_of_the_forward_is_still_refused_naming_both() -> None:
    """The hook's call is not counted; the forward's own second call is, named with the one
    that took the strategy."""
    net = TwoCalls(8, 8)
    net.register_forward_pre_hook(_double)
    sw.shard(net, in_strategy=((1, 1), (2, 1)))
    with simulated_world(RANKS) as world:
        world.replicate(net)
        with pytest.raises(
            ValueError,
            match=r"sw.shard on .*forward, torch.nn.functional.linear at .*also "
            r"called .*mul.*reshard",
        ):
            sw.AutoParallel(net)(world.rows(X))


def test_a_hook_that_cannot_be_told_apart_is_named() -> None:
    """A forward without code to read (a ``functools.partial``): the hook's call counts as the
    forward's, and the refusal names it and where to register the hook instead."""
    net = nn.Linear(8, 8)
    net.forward = functools.partial(nn.Linear.forward, net)  # type: ignore[method-assign]
    net.register_forward_pre_hook(_double)
    sw.shard(net, in_strategy=((1, 1), (2, 1)))
    with simulated_world(RANKS) as world:
        world.replicate(net)
        with pytest.raises(
            ValueError,
            match=r"sw.shard on the top-level Linear: .*forward, torch.Tensor.mul at .*also "
            r"called torch.nn.functional.linear.*its forward, a partial, cannot be read: the "
            r"calls of its hooks count",
        ):
            sw.AutoParallel(net)(world.rows(X))
