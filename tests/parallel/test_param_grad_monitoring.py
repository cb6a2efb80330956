"""Gradients of parameters from a ``torch.autograd.grad(..., retain_graph=True)`` inside a train
step, read by the step's own ops (VQGAN's adaptive weight: the norms of two losses' gradients of
the last layer's weight weigh the second loss; a gradient-norm monitor).

Under Megatron annotations such a gradient came back as this rank's block of a split weight's
gradient while the plan read it as a value whole on every rank (capture saw its global shape):
each rank took the norm of its own block, so the loss differed per rank and the gradients were
wrong. Now the gradients a graph-keeping ``torch.autograd.grad`` returns of a parameter stored
as a block are gathered whole, one device's, on every rank: loss, gradients and parameters equal
one device's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import assert_matches_single_device, simulated_world

T = torch.Tensor
g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: T) -> T:
        return self.fc2(torch.relu(self.fc1(x)))


def adaptive(net: Net, x: T, y: T) -> tuple[T, T]:
    """VQGAN's ``calculate_adaptive_weight`` on the last layer's weight."""
    out = net(x)
    nll, g_loss = F.cross_entropy(out, y), out.pow(2).mean()
    (ng,) = torch.autograd.grad(nll, net.fc2.weight, retain_graph=True)
    (gg,) = torch.autograd.grad(g_loss, net.fc2.weight, retain_graph=True)
    w = (torch.norm(ng) / (torch.norm(gg) + 1e-4)).clamp(0, 1e4).detach()
    return nll + w * g_loss, w


def grad_norm(net: Net, x: T, y: T) -> tuple[T, T]:
    """A monitor: the sum of squares of every parameter's gradient, before the backward."""
    loss = F.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    return loss, sum(gr.pow(2).sum() for gr in grads)


LOSSES: dict[str, Callable[[Net, T, T], tuple[T, T]]] = {
    "adaptive weight": adaptive,
    "grad-norm monitor": grad_norm,
}


def stepper(net: Net, loss_of: Any, grads: list[dict[str, T]]) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: T, y: T) -> tuple[T, T]:
        loss, value = loss_of(net, x, y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        return loss, value

    return step


@pytest.mark.parametrize("which", list(LOSSES))
@pytest.mark.parametrize("ranks", [2, 4])
def test_megatron_param_grads_read_in_the_step_are_one_devices(which: str, ranks: int) -> None:
    loss_of = LOSSES[which]
    ref, want_grads = Net(), []
    one = stepper(ref, loss_of, want_grads)
    want = [tuple(t.detach() for t in one(x, y)) for x, y in DATA]
    net, seen = Net(), []
    dp = ranks // 2
    with simulated_world(ranks) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((dp, 1), (2, 1)))
        sw.shard(net.fc2, in_strategy=((dp, 2), (1, 2)))
        parallel = sw.AutoParallel(stepper(net, loss_of, seen))
        got = [parallel(world.rows(x), world.rows(y)) for x, y in DATA]
        plan = parallel.parallel_plan
        assert plan is not None
        assert plan.params["fc2.weight"].layout.used_axes()  # (the weight is split)

        def block(name: str, full: T) -> Callable[[int], T]:
            layout = plan.params[name].layout
            return lambda r: full[layout.local_index(r, tuple(full.shape))]

        for i, ((loss, value), (loss_1, value_1)) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(loss, loss_1, what=f"{which}: loss {i}")
            assert_matches_single_device(value, value_1, what=f"{which}: value {i}")
            for name, full in want_grads[i].items():
                assert_matches_single_device(
                    seen[i][name], block(name, full), what=f"{which}: grad {i} {name}"
                )
        for name, p in ref.named_parameters():
            assert_matches_single_device(
                net.get_parameter(name).detach(), block(name, p.detach()), what=name
            )


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_param_grads_under_optimizer_parallel_are_refused(level: str) -> None:
    """hsdp computes with a gathered copy of each parameter, so torch found no gradient of the
    Parameter and raised its own "appears to not have been used in the graph" error; the
    refusal now names the call, the parameter and the fix."""
    net, seen = Net(), []
    x, y = DATA[0]
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, grad_norm, seen))
        parallel.hsdp(threshold=0, optimizer_level=level)
        with pytest.raises(UnsupportedParallelError, match=r"autograd\.grad.*'fc1\.weight'"):
            parallel(world.rows(x), world.rows(y))
