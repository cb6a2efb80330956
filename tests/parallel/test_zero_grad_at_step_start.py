"""Gradients zeroed in place at the START of a wrapped semi_auto train step (before its
forward): ``net.zero_grad(set_to_none=False)``, or a loop of ``p.grad.zero_()``.

At the first call every ``.grad`` is None, so the capture saw no zeroing; from the second call
the ``.grad`` tensors exist and their in-place ops reached the plan executor as network ops the
plan lacked: the call was planned again, and the same plan (the capture's parameters are fakes
without gradients) failed at once with an UnsupportedParallelError about reading a shape in a
Python loop. Ops on a parameter's ``.grad`` before the forward are no network ops: they run as
between calls. 2 simulated ranks of plain data parallel (and optimizer parallel level 1), three
calls, each loss and the parameters equal to one device's, with the collectives of a step
that does not zero (none added).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

RANKS = (0, 1)
g = torch.Generator().manual_seed(1)
BATCHES = [
    (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(F.relu(self.l1(x))), y)


Opt = torch.optim.Optimizer
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def module_zero_grad(net: nn.Module, opt: Opt) -> None:
    net.zero_grad(set_to_none=False)


def manual_loop(net: nn.Module, opt: Opt) -> None:
    for p in net.parameters():
        if p.grad is not None:
            p.grad.zero_()


def halve(net: nn.Module, opt: Opt) -> None:
    for p in net.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)  # (accumulating with a decay across calls)


def optimizer_zero_grad(net: nn.Module, opt: Opt) -> None:
    opt.zero_grad(set_to_none=False)


def train_step(net: nn.Module, opt: Opt, zero: Callable[[nn.Module, Opt], None]) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zero(net, opt)  # (before the forward)
        loss = net(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def built(grads_before: bool) -> Net:
    """The network; `grads_before`: its parameters hold a ``.grad`` (ones) at the first call."""
    net = Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p) if grads_before else None
    return net


def held(parallel: sw.AutoParallel, name: str, full: torch.Tensor) -> Any:
    """What each rank holds of the one-device parameter `full`: all of it, or under hsdp the
    dim-0 part its shard is (rank -> rows)."""
    plan = parallel.optimizer_plan
    shard = plan.param(name) if plan is not None else None
    if shard is None or not shard.sharded:
        return full
    n = shard.shard_shape[0]
    return lambda r: full[r * n : (r + 1) * n]


@pytest.mark.parametrize(
    ("zero", "level", "grads_before"),
    [
        (module_zero_grad, None, False),
        (manual_loop, None, False),
        (module_zero_grad, "level1", False),
        (module_zero_grad, None, True),
        (optimizer_zero_grad, None, True),
        (halve, None, True),
    ],
    ids=[
        "module-zero_grad",
        "manual-loop",
        "module-zero_grad-hsdp-level1",
        "module-zero_grad-grads-at-first-call",
        "optimizer-zero_grad-grads-at-first-call",
        "halved-grads-at-first-call",
    ],
)
def test_zeroing_before_the_forward(
    zero: Callable[[nn.Module, Opt], None], level: str | None, grads_before: bool
) -> None:
    """Each call's loss and parameters are one device's, with no collective added; the plan
    has no op on a gradient (also when the first call's capture finds them: an optimizer holds
    the real parameters)."""
    ref = built(grads_before)
    ref_step = train_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), zero)
    want = []
    for x, y in BATCHES:
        want.append(
            (ref_step(x, y).detach(), {n: p.detach().clone() for n, p in ref.named_parameters()})
        )
    net = built(False)
    with simulated_world(2) as world:
        world.replicate(net)  # (which drops a ``.grad``: given again on the ranks)
        for p in net.parameters():
            p.grad = torch.ones_like(p) if grads_before else None
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        parallel = sw.AutoParallel(train_step(net, opt, zero), parallel_mode="semi_auto")
        if level is not None:
            parallel.hsdp(threshold=0, optimizer_level=level)
        kinds = []
        for i, (x, y) in enumerate(BATCHES):
            with CommRecorder() as rec:
                loss = parallel(world.rows(x), world.rows(y))
            kinds.append(rec.kinds())
            want_loss, want_params = want[i]
            assert_matches_single_device(loss, want_loss, what=f"loss of call {i}")
            for name, full in want_params.items():
                got = net.get_parameter(name).detach()
                want_p = held(parallel, name, full)
                assert_matches_single_device(got, want_p, what=f"{name} after call {i}")
        ops = {node.op for node in parallel.plan().nodes}
    assert not ops & {"torch.Tensor.zero_", "torch.Tensor.requires_grad_", "torch.Tensor.mul_"}
    if level is None:  # the loss's AllReduce and one gradient bucket, every call
        one = Counter({("AllReduce", "forward", RANKS): 1, ("AllReduce", "backward", RANKS): 1})
        assert kinds == [one] * 3, kinds
    else:  # zeroing adds no collective: each call's are the first call's (which zeroes none)
        assert kinds[0].get(("ReduceScatter", "step", RANKS)), kinds[0]
        assert kinds[1] == kinds[2] == kinds[0], kinds


class Reset(Net):
    """A forward that starts with an in-place op of the same name as the zeroing's: a buffer's
    ``zero_()``, the plan's first node."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.ones(32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.acc.zero_()
        return F.cross_entropy(self.head(F.relu(self.l1(x)) + self.acc), y)


def test_zeroing_before_a_forward_that_starts_with_zero_() -> None:
    ref = Reset()
    ref_step = train_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), module_zero_grad)
    want = [ref_step(x, y).detach() for x, y in BATCHES]
    net = Reset()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = train_step(net, opt, module_zero_grad)
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        for i, (x, y) in enumerate(BATCHES):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[i], what=f"loss of call {i}")


def test_a_norm_of_a_split_gradient_before_the_forward_is_refused_not_taken_per_rank() -> None:
    """Only element-by-element resets and scalings pass unexamined: a norm of a gradient split
    over the ranks (a column-parallel layer's) would be each rank's block's."""
    net = Net()

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        w = net.l1.weight
        before = w.grad.norm() if w.grad is not None else None
        loss = net(x, y)
        loss.backward()
        return loss, before

    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.l1, in_strategy=((1, 1), (2, 1)))
        parallel = sw.AutoParallel(step, parallel_mode="semi_auto")
        x, y = BATCHES[0]
        parallel(world.rows(x), world.rows(y))
        with pytest.raises(sw.parallel.UnsupportedParallelError, match=r"torch\.Tensor\.norm"):
            parallel(world.rows(x), world.rows(y))
