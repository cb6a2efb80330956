"""TorchScript in a wrapped network or train step (``torch.jit.script`` / ``torch.jit.trace``).

A TorchScript module or function runs its ops in the TorchScript interpreter, which capture
does not see, so the plan lacked them: on simulated ranks the call failed with "The following
operation failed in the TorchScript interpreter" and an empty message, in real jobs with
messages blaming a Python loop or branch. Every planned mode now refuses it at the first call
with a `CaptureError` (a ValueError) naming the submodule (or function) and the fixes, the eager
module or ``parallel_mode="data_parallel"``; the latter trains such a network as one device.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import CaptureError
from shardwise.testing import assert_matches_single_device, simulated_world

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning"),
]

G = torch.Generator().manual_seed(1)
X, Y = torch.randn(8, 8, generator=G), torch.randint(0, 4, (8,), generator=G)


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2


def make(variant: str = "eager") -> nn.Sequential:
    """Linear -> Act -> Linear, with the first Linear or the Act made TorchScript."""
    torch.manual_seed(0)
    first: nn.Module = nn.Linear(8, 16)
    act: nn.Module = Act()
    if variant == "script_linear":
        first = torch.jit.script(first)
    if variant == "trace_linear":
        first = torch.jit.trace(first, torch.randn(4, 8))
    if variant == "script_act":
        act = torch.jit.script(act)
    return nn.Sequential(first, act, nn.Linear(16, 4))


def stepper(net: nn.Module, loss: Callable[..., torch.Tensor] | None = None) -> Callable:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = F.cross_entropy(net(a), b) if loss is None else loss(a, b)
        out.backward()
        opt.step()
        opt.zero_grad()
        return out

    return step


@pytest.mark.parametrize(
    ("variant", "named"),
    [
        ("script_linear", "submodule '0' (RecursiveScriptModule of Linear)"),
        ("trace_linear", "submodule '0' (TopLevelTracedModule of Linear)"),
        ("script_act", "submodule '1' (RecursiveScriptModule of Act)"),
    ],
)
@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_a_torchscript_submodule_is_refused_naming_it_and_the_fixes(
    variant: str, named: str, mode: str
) -> None:
    net = make(variant)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode=mode)
        with pytest.raises(CaptureError) as caught:
            parallel(world.rows(X), world.rows(Y))
    said = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert f"AutoParallel: {named} is a TorchScript module" in said, said
    assert "Use the eager module" in said and "parallel_mode='data_parallel'" in said, said


def test_a_torchscript_teacher_and_function_of_the_step_are_refused() -> None:
    """A module the train step uses besides the network (a frozen teacher) and a scripted
    function the step calls run in the interpreter too (refused before either runs)."""
    teacher = torch.jit.script(nn.Linear(8, 4))

    @torch.jit.script
    def double_tanh(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2

    cases = {
        "a module the train step uses besides the network (RecursiveScriptModule of Linear)": (
            lambda net: lambda a, b: F.mse_loss(net(a), teacher(a).detach())
        ),
        "the train step calls 'double_tanh', a TorchScript function": (
            lambda net: lambda a, b: F.cross_entropy(double_tanh(net(a)), b)
        ),
    }
    for named, loss in cases.items():
        net = make()
        with simulated_world(2) as world:
            world.replicate(net)
            step = stepper(net, loss(net))
            parallel = sw.AutoParallel(step, network=net, parallel_mode="semi_auto")
            with pytest.raises(CaptureError, match="Use the ") as caught:
                parallel(world.rows(X), world.rows(Y))
        assert named in str(caught.value), caught.value


@pytest.mark.parametrize("variant", ["script_linear", "trace_linear", "script_act"])
def test_data_parallel_trains_a_torchscript_submodule_as_one_device(variant: str) -> None:
    single = make(variant)
    one = stepper(single)
    want = [one(X, Y).detach() for _ in range(2)]
    net = make(variant)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="data_parallel")
        for i in range(2):
            assert_matches_single_device(
                parallel(world.rows(X), world.rows(Y)), want[i], what=f"loss {i}"
            )
        for (name, p), q in zip(net.named_parameters(), single.parameters(), strict=True):
            assert_matches_single_device(p.detach(), q.detach(), what=name)
