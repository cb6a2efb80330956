"""Ops that return their input object unchanged (``h.to(torch.float32)`` on a float32 ``h``,
``h.float()``, ``h.type_as(h)``, ``torch.atleast_2d``, dropout in eval) under `AutoParallel`.

The capture took the op's output for the input's own value from then on, so a later read of
the input object (a T5-style RMSNorm: ``h * torch.rsqrt(h.to(torch.float32).pow(2).mean(...))``)
read the op's output, which the plan may hold apart from the input (moved for the op): under
sharding_propagation the whole ``h`` was multiplied by this rank's rows of the variance
(``RuntimeError: The size of tensor a (4) must match the size of tensor b (2)``). Now such an
op's output is a value of its own and the input object keeps its value: every variant trains
as one device under sharding_propagation and semi_auto, on 2 simulated ranks.
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

STEPS, LR = 3, 0.1
IDENTITY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_float32": lambda h: h.to(torch.float32),
    "to_dtype_keyword": lambda h: h.to(dtype=h.dtype),
    "float": lambda h: h.float(),
    "type_as": lambda h: h.type_as(h),
    "atleast_2d": torch.atleast_2d,
    "dropout_in_eval": lambda h: F.dropout(h, 0.5, training=False),
}
MODES = ["sharding_propagation", "semi_auto"]

g = torch.Generator().manual_seed(1)
DATA = [torch.randn(4, 8, generator=g) for _ in range(STEPS)]  # (made outside the world)


class RMSNorm(nn.Module):
    """T5's layer norm: the variance of `identity(h)`, then `h` itself scaled by it."""

    def __init__(self, identity: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8) + 0.1 * torch.arange(8.0))
        self.identity = identity

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        var = self.identity(h).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + 1e-6))


class Net(nn.Module):
    """A Linear annotated whole, the norm, a Linear annotated with its rows split."""

    def __init__(self, identity: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 8, bias=False)
        self.norm = RMSNorm(identity)
        self.fc2 = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x))).square().mean()


def _single(identity: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[torch.Tensor], Net]:
    net = Net(identity)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x in DATA:
        loss = net(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, net


def _trained(world: Any, net: nn.Module, mode: str, want: list[torch.Tensor]) -> Any:
    """`net` trained in `mode` on `DATA` (each rank its rows) with SGD, each loss equal to
    one device's (`want`); returns the wrapper."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = sw.AutoParallel(step, parallel_mode=mode)
    for i, x in enumerate(DATA):
        assert_matches_single_device(parallel(world.rows(x)), want[i], what=f"loss {i}")
    return parallel


def _check(identity: Callable[[torch.Tensor], torch.Tensor], mode: str) -> None:
    """`STEPS` SGD steps on 2 ranks equal one device: each loss, each parameter after."""
    want, ref = _single(identity)
    net = Net(identity)
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.fc1, in_strategy=((1, 1), (1, 1)))  # whole
        sw.shard(net.fc2, in_strategy=((2, 1), (1, 1)))  # rows split
        parallel = _trained(world, net, mode, want)
        plan = parallel.parallel_plan
        assert plan is not None
        for name, p in ref.named_parameters():
            layout, full = plan.params[name].layout, p.detach()
            block = lambda r, f=full, lay=layout: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
            assert_matches_single_device(net.get_parameter(name).detach(), block, what=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(IDENTITY))
def test_an_op_returning_its_input_trains_as_one_device(op: str, mode: str) -> None:
    _check(IDENTITY[op], mode)


class T5LayerNorm(nn.Module):
    """Hugging Face's T5LayerNorm, its forward as written there."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8) + 0.1 * torch.arange(8.0))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5Block(nn.Module):
    """An embedding Linear, T5's pre-norm MLP (wi, ReLU, wo; no residual: the final norm
    reads wo's partial sums), the final norm and a head with its input rows split (the final
    norm's cast is planned on rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8, bias=False)
        self.norm, self.final_norm = T5LayerNorm(), T5LayerNorm()
        self.wi, self.wo = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.wo(F.relu(self.wi(self.norm(h))))
        return self.head(self.final_norm(h)).square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_t5_style_block_with_megatron_annotations_trains_as_one_device(mode: str) -> None:
    """T5LayerNorm's own code, without Hugging Face (``h.to(torch.float32)`` returns ``h``
    on a float32 network), around a Megatron MLP (wi columns, wo rows split), before a head
    whose input rows are split."""
    ref = T5Block()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    want = []
    for x in DATA:
        loss = ref(x)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        want.append(loss.detach())
    net = T5Block()
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(net.embed, in_strategy=((1, 1), (1, 1)))
        sw.shard(net.wi, in_strategy=((1, 1), (2, 1)))
        sw.shard(net.wo, in_strategy=((1, 2), (1, 2)))
        sw.shard(net.head, in_strategy=((2, 1), (1, 1)))  # rows split
        _trained(world, net, mode, want)
