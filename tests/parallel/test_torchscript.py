"""TorchScript in a wrapped network or train step (``torch.jit.script`` / ``torch.jit.trace``).

A TorchScript module or function runs its ops in the TorchScript interpreter, which capture
does not see, so the plan lacked them: on simulated ranks the call failed with "The following
operation failed in the TorchScript interpreter" and an empty message, in real jobs with
messages blaming a Python loop or branch. Every planned mode refuses TorchScript that runs
during the capture (a scripted submodule, a module the step uses besides the network, a
scripted function called by the step or inside a module's forward, as Megatron's fused
bias-gelu is) with a `CaptureError` (a ValueError) naming the module (or the function and its
line) and the fixes, the eager module or ``parallel_mode="data_parallel"``; the latter trains
such a network as one device. TorchScript the capture does not run is not refused: a
ScriptModule the network only holds, a scripted metric after the update, a scripted function
in a branch the step does not take.
"""

from __future__ import annotations

import inspect
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
        "'double_tanh', a TorchScript function (torch.jit.script), runs at": (
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


@torch.jit.script
def fused_act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


class InForward(nn.Module):
    """A scripted function called inside the forward (Megatron's fused bias-gelu)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(fused_act(self.a(x)))


@pytest.mark.parametrize(
    ("form", "mode"), [("module", "semi_auto"), ("step", "sharding_propagation")]
)
def test_a_scripted_function_inside_a_forward_is_refused_naming_it_and_its_line(
    form: str, mode: str
) -> None:
    net = InForward()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net if form == "module" else stepper(net), parallel_mode=mode)
        with pytest.raises(CaptureError) as caught:
            if form == "module":
                parallel(world.rows(X))
            else:
                parallel(world.rows(X), world.rows(Y))
    said = str(caught.value)
    assert isinstance(caught.value, ValueError)
    line = inspect.getsourcelines(InForward.forward)[1] + 1  # (its line calling fused_act)
    assert said.startswith(
        "AutoParallel: 'fused_act', a TorchScript function (torch.jit.script), runs at "
        f"test_torchscript.py:{line}:"
    ), said
    assert "Use the Python function given to torch.jit.script" in said, said
    assert "parallel_mode='data_parallel'" in said, said


def test_scripted_code_found_by_no_name_is_refused_naming_the_line() -> None:
    """A scripted function reached through a container: the op and the line are named."""
    table = {"act": fused_act}
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        step = stepper(net, lambda a, b: F.cross_entropy(table["act"](net(a)), b))
        parallel = sw.AutoParallel(step, network=net, parallel_mode="semi_auto")
        with pytest.raises(CaptureError) as caught:
            parallel(world.rows(X), world.rows(Y))
    said = str(caught.value)
    assert "AutoParallel: aten.tanh.default runs at test_torchscript.py:" in said, said
    assert "no torch-level call around it, as in TorchScript code" in said, said


class HoldsUnused(nn.Module):
    """Holds a ScriptModule (say, for export) that its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.exported = torch.jit.script(nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * 2)


def test_a_held_scriptmodule_never_called_trains_as_one_device() -> None:
    single = HoldsUnused()
    want_out = single(X).detach()
    one = stepper(single)
    want = [one(X, Y).detach() for _ in range(2)]
    net, held = HoldsUnused(), HoldsUnused()
    with simulated_world(2) as world:
        world.replicate(net)
        world.replicate(held)
        out = sw.AutoParallel(held)(world.rows(X))
        assert_matches_single_device(out, world.rows(want_out), what="module form")
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        for i in range(2):
            assert_matches_single_device(
                parallel(world.rows(X), world.rows(Y)), want[i], what=f"loss {i}"
            )


@torch.jit.script
def accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == y).float().mean()


@torch.jit.script
def scripted_act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def test_a_scripted_metric_after_the_update_is_not_refused() -> None:
    """Capture stops at ``backward()``: a scripted metric after ``opt.step()`` is not captured
    and runs on each rank's own rows, as the step's code after ``backward()`` does."""

    def metric_step(net: nn.Module, logits: list[torch.Tensor]) -> Callable:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = net(a)
            loss = F.cross_entropy(out, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            logits.append(out.detach())
            return loss, accuracy(out.detach(), b)

        return step

    logits: list[torch.Tensor] = []
    one = metric_step(make(), logits)
    want = [one(X, Y)[0].detach() for _ in range(2)]
    net = make()
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(metric_step(net, []), parallel_mode="semi_auto")
        for i in range(2):
            loss, metric = parallel(world.rows(X), world.rows(Y))
            assert_matches_single_device(loss, want[i], what=f"loss {i}")
            mine = [accuracy(o, y) for o, y in zip(logits[i].chunk(2), Y.chunk(2), strict=True)]
            assert_matches_single_device(metric, mine.__getitem__, what=f"metric {i}")


def test_a_scripted_function_in_a_branch_not_taken_is_not_refused() -> None:
    """The step refers to a scripted function only in a branch it does not take (its first
    layer ``torch.compile``d)."""

    def branch_step(net: nn.Module, scripted: bool = False) -> Callable:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            h = net[0](a)
            if scripted:
                h = scripted_act(h)
            loss = F.cross_entropy(net[2](h), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    one = branch_step(make())
    want = [one(X, Y).detach() for _ in range(2)]
    net = make()
    net[0] = torch.compile(net[0], backend="eager")
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(branch_step(net), parallel_mode="semi_auto")
        for i in range(2):
            assert_matches_single_device(
                parallel(world.rows(X), world.rows(Y)), want[i], what=f"loss {i}"
            )
