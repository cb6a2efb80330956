"""Custom ``torch.autograd.Function``s in a planned step: their own backward runs on blocks.

A Function whose forward the plan keeps free of collectives trains like one device: a fused
row-wise op on data-parallel rows, and a loss Function returning a partial mean that the plan
reduces after it. One whose forward would need a collective inside (a mean over a split dim)
is refused at planning, in every planning mode, naming the Function, the op and the fix; with
the fix (the input resharded whole on that dim) it matches one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.layout import Layout
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

ROWS, STEPS = 8, 2


class Center(torch.autograd.Function):
    """x minus its row mean, with a hand-written backward (not elementwise)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g - g.mean(-1, keepdim=True)


class Normalize(torch.autograd.Function):
    """A hand-written layer norm without affine: ops several deep in its forward (the output op
    reads no input of the Function), its backward by hand."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(-1, keepdim=True)
        scale = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + 1e-5)
        out = centered * scale
        ctx.save_for_backward(out, scale)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out, scale = ctx.saved_tensors
        mean_g = g.mean(-1, keepdim=True)
        mean_go = (g * out).mean(-1, keepdim=True)
        return scale * (g - mean_g - out * mean_go)  # type: ignore[no-any-return]


class SquaredError(torch.autograd.Function):
    """The mean over rows of the squared error (a loss Function), new-style setup_context."""

    @staticmethod
    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x - y) ** 2).sum(-1).mean()

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, y = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * 2 * (x - y) / x.shape[0], None


class Net(nn.Module):
    def __init__(
        self,
        column_parallel: bool,
        whole: bool = False,
        function: Any = Center,
        scale: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.whole, self.function, self.scale = whole, function, scale
        if column_parallel:
            sw.shard(self.l1, in_strategy=((2, 1), (2, 1)))  # its output split on dim 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.whole:
            h = sw.reshard(h, Layout((2, 2), ("dp", "mp"))("dp", "None"))
        if self.scale:  # (fp8-style: a statistic without gradient, taken before the Function)
            with torch.no_grad():
                peak = h.abs().amax(-1, keepdim=True)
            h = h / (peak + 1)
        return self.l2(torch.tanh(self.function.apply(h)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g))
            for _ in range(STEPS)]  # fmt: skip


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run(make: Callable[[], Net], loss_of: Loss, mode: str = "semi_auto") -> list[CommRecorder]:
    """Train `make()` for STEPS on 4 simulated ranks and compare every loss and gradient with
    one device's."""
    data, base = batches(), make()
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    want = []
    for x, y in data:
        loss = loss_of(base(x), y)
        loss.backward()
        want.append((loss.detach(), {n: p.grad.clone() for n, p in base.named_parameters()}))
        opt.step()
        opt.zero_grad()
    net, got, recs = make(), [], []
    with simulated_world(4) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = loss_of(net(inputs), targets)
            loss.backward()
            got.append({n: p.grad.clone() for n, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode=mode)
        for s, (x, y) in enumerate(data):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            recs.append(rec)
            assert_matches_single_device(loss, want[s][0], what=f"loss {s}")
            for name, p in parallel.parallel_plan.params.items():
                full = want[s][1][name]
                assert_matches_single_device(
                    got[s][name],
                    lambda r, full=full, layout=p.layout: full[layout.local_index(r, full.shape)],
                    what=f"{name}.grad step {s}",
                )
    return recs


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def test_a_function_on_data_parallel_rows_and_a_loss_function_match_one_device() -> None:
    recs = run(lambda: Net(column_parallel=False), SquaredError.apply)
    # the loss Function's partial mean is reduced after it: one AllReduce forward, none inside
    assert recs[0].count("AllReduce", phase="forward") == 1


@pytest.mark.parametrize(
    ("mode", "function"),
    [("semi_auto", Center), ("sharding_propagation", Center), ("semi_auto", Normalize)],
)
def test_a_collective_inside_a_function_is_refused_with_the_fix(mode: str, function: Any) -> None:
    name = function.__name__
    with pytest.raises(sw.planner.PlanError, match=rf"Function {name}: the plan runs \w+"
                       r".*test_custom_functions.py:\d+.*sw\.reshard"):  # fmt: skip
        run(lambda: Net(column_parallel=True, function=function), mse, mode)


def test_a_function_after_a_no_grad_statistic_matches_one_device() -> None:
    """A statistic taken under ``no_grad`` before the Function (fp8-style scaling) is not part
    of it: the input resharded whole, the step matches one device."""
    run(lambda: Net(column_parallel=True, whole=True, scale=True), mse)


def test_the_fix_resharding_its_input_whole_matches_one_device() -> None:
    run(lambda: Net(column_parallel=True, whole=True), mse)
