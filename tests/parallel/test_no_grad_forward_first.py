"""A train step that runs the network under ``torch.no_grad()`` before its training forward: a
self-distillation target, or an output only logged (``torch.inference_mode()``, whose views a
simulated world's tensors cannot take: tests/multiprocess/test_no_grad_forward_first_real.py).

Under Megatron annotations the row-parallel layer's bias enters its op kept on the first
model-parallel rank (zeros on the others); the training forward reused that block, moved once
for the whole step, and the no-grad forward had moved it without an autograd link: the bias got
no gradient (``.grad`` None on every rank) and was never updated, and every parameter drifted
from one device's from the second step on. Now a move made in one grad mode is reused only in
that mode: loss, every gradient and the parameters after two steps equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def build(dp: int = 0) -> nn.Sequential:
    """The network; with `dp` > 0, Megatron annotations (model parallel 2, data parallel `dp`)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if dp:
        sw.shard(net[0], in_strategy=((dp, 1), (2, 1)))  # column parallel
        sw.shard(net[2], in_strategy=((dp, 2), (1, 2)))  # row parallel (its bias kept on one)
    return net


def unused(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        net(x)  # (its output not even read)
    return F.cross_entropy(net(x), y)


def distilled(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        t = net(x).softmax(-1)
    out = net(x)
    return F.cross_entropy(out, y) + (out.log_softmax(-1) * -t).sum(-1).mean()


Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def stepper(net: nn.Module, loss_of: Loss, grads: list[dict[str, torch.Tensor]]) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(net, x, y)
        loss.backward()
        grads.append(
            {n: p.grad.clone() if p.grad is not None else None for n, p in net.named_parameters()}
        )
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("loss_of", [unused, distilled])
@pytest.mark.parametrize("ranks", [2, 4])
def test_no_grad_forward_before_training_forward_trains_as_one_device(
    ranks: int, loss_of: Loss
) -> None:
    ref = build()
    want: list[dict[str, torch.Tensor]] = []
    one = stepper(ref, loss_of, want)
    losses = [one(x, y).detach() for x, y in DATA]
    net = build(dp=ranks // 2)
    seen: list[dict[str, torch.Tensor]] = []
    with simulated_world(ranks) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, loss_of, seen), parallel_mode="semi_auto")
        got = [parallel(world.rows(x), world.rows(y)) for x, y in DATA]
        plan = parallel.parallel_plan
        assert plan is not None

        def block(name: str, full: torch.Tensor) -> Callable[[int], torch.Tensor]:
            layout = plan.params[name].layout
            return lambda r: full[layout.local_index(r, tuple(full.shape))]

        for i, (loss, expected) in enumerate(zip(got, losses, strict=True)):
            assert_matches_single_device(loss, expected, what=f"loss {i}")
            for name, full in want[i].items():
                assert seen[i][name] is not None, f"step {i}: {name} got no gradient"
                assert_matches_single_device(
                    seen[i][name], block(name, full), what=f"grad {i} {name}"
                )
        for name, p in ref.named_parameters():
            assert_matches_single_device(
                net.get_parameter(name).detach(), block(name, p.detach()), what=name
            )


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_no_grad_forward_first_under_optimizer_parallel_trains_as_one_device(level: str) -> None:
    """The same with hsdp's compute leaves (level 3 frees and gathers them again)."""
    ref = build()
    one = stepper(ref, distilled, [])
    data = [*DATA, DATA[0]]
    losses = [one(x, y).detach() for x, y in data]
    net = build(dp=2)
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, distilled, []), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        for i, ((x, y), expected) in enumerate(zip(data, losses, strict=True)):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, expected, what=f"loss {i}")
