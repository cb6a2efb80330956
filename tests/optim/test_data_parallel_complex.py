"""``parallel_mode="data_parallel"`` with complex parameters (complex64), alone in their
gradient bucket or beside float32 and float64 ones, with and without ``hsdp()``.

The optimizer step's fused AllReduce appended each member's count of ranks that had a gradient
to the bucket in the bucket's dtype: a complex bucket's counts were complex and reading them
raised ``TypeError: '<' not supported between instances of 'complex' and 'float'``. A complex
bucket now travels as its real view (real and imaginary parts, the counts real numbers): the
losses, the averaged gradients and the parameters after each step equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
BATCHES = [torch.randn(8, 4, generator=g) for _ in range(3)]


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 8)
        self.c = nn.Parameter(torch.randn(8, 3, dtype=torch.complex64))
        self.d = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.spare = nn.Parameter(torch.randn(2, dtype=torch.complex64)) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x).to(torch.complex64) @ self.c
        return torch.view_as_real(z * self.d.float()).pow(2).mean() + self.d.sum().float()


def stepper(net: Net) -> Callable[[torch.Tensor], dict[str, Any]]:
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    def step(x: torch.Tensor) -> dict[str, Any]:
        loss = net(x)
        loss.backward()
        opt.step()  # (data_parallel mode averages the gradients in the step's pre-hook)
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        opt.zero_grad()
        return {"loss": loss.detach(), "grads": grads}

    return step


def one_device(unused: bool = False) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    net = Net(unused)
    step = stepper(net)
    out = [step(x) for x in BATCHES]
    return out, {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("hsdp", [False, True])
def test_complex_parameters_match_single_device(world_size: int, fused: bool, hsdp: bool) -> None:
    """Three Adam steps; `fused`: every parameter in one comm_fusion id (buckets still one
    dtype each); `hsdp`: the owner-update optimizer parallel (each rank steps its owned
    parameters, then broadcasts them)."""
    want, want_params = one_device()
    net = Net()
    with simulated_world(world_size) as world:
        world.replicate(net)
        if fused:
            sw.set_comm_fusion(net, 1)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="data_parallel")
        if hsdp:
            parallel = parallel.hsdp(threshold=0)
        for i, x in enumerate(BATCHES):
            got = parallel(world.rows(x))
            assert_matches_single_device(got["loss"], want[i]["loss"], what=f"loss {i}")
            if not hsdp:  # (under hsdp only the owner's gradient is averaged)
                assert_matches_single_device(got["grads"], want[i]["grads"], what=f"grads {i}")
        params = {n: p.detach() for n, p in net.named_parameters()}
        assert_matches_single_device(params, want_params, what="params")


def test_an_unused_complex_parameter_keeps_no_gradient() -> None:
    """A complex parameter no rank used keeps ``.grad`` None on every rank (as DDP's unused
    ones), the others averaged as one device's."""
    want, want_params = one_device(unused=True)
    net = Net(unused=True)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="data_parallel")
        for i, x in enumerate(BATCHES):
            got = parallel(world.rows(x))
            assert "spare" not in got["grads"]
            assert_matches_single_device(got["grads"], want[i]["grads"], what=f"grads {i}")
        params = {n: p.detach() for n, p in net.named_parameters()}
        assert_matches_single_device(params, want_params, what="params")
