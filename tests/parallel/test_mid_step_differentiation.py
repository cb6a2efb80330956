"""Differentiation inside a train step that a plan cannot capture is refused at capture.

- A gradient ``torch.autograd.grad(out.sum(), x, retain_graph=True)`` of an input or activation
  (a saliency), used in the loss: the capture took it as one whole constant while each rank's
  gradient holds only its rows, and the run failed with an internal "redistribute: the local
  block has shape [4, 1] but layout (None, None) ..." (Megatron: torch's "size of tensor a (8)
  must match ... (4)"). Now a `CaptureError` names torch.autograd.grad, the tensor and the fix.
  A parameter's gradient (one device's on every rank) still trains as one device.
- ``torch.func`` transforms (``vmap(grad(...))``, ``vmap(jacrev(...))``) and
  ``torch.autograd.functional.jvp``: errors about ``aten.sym_stride``, an annotation to change,
  a ``fill_`` on a view, or a backward from an unknown tensor, none naming the transform. Now a
  `CaptureError` names it, its line and the fix; ``parallel_mode="data_parallel"`` runs them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import shardwise as sw
from shardwise.planner import CaptureError
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(5)
X, Y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
MODES = [("semi_auto", False), ("semi_auto", True), ("sharding_propagation", False)]


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def saliency_loss(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.clone().requires_grad_()
    out = net(a)
    (s,) = torch.autograd.grad(out.sum(), a, retain_graph=True)
    return F.cross_entropy(out, b) + 0.1 * (out * s.sum(1, keepdim=True)).mean()


def weight_loss(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = net(a)
    (gw,) = torch.autograd.grad(out.sum(), net[2].weight, retain_graph=True)
    return F.cross_entropy(out, b) + 0.1 * (net[2].weight * gw).sum()


def per_sample_loss(net: nn.Module, a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "vmap(grad)":
        p = dict(net.named_parameters())
        gx = vmap(grad(lambda xx: functional_call(net, p, (xx.unsqueeze(0),)).sum()))(a)
    elif kind == "vmap(jacrev)":
        gx = vmap(jacrev(lambda xx: net(xx.unsqueeze(0)).squeeze(0)))(a)
    else:
        _, gx = torch.autograd.functional.jvp(net, (a,), (torch.ones_like(a),))
    return F.cross_entropy(net(a), b) + 0.1 * gx.pow(2).mean()


def stepper(net: nn.Module, loss_of: Any) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.5)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = loss_of(net, a, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def one_device(loss_of: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one step of `loss_of` and the parameters after it."""
    net = build()
    loss = stepper(net, loss_of)(X, Y)
    return loss, {n: p.detach() for n, p in net.named_parameters()}


def parallel(loss_of: Any, mode: str, megatron: bool = False) -> Any:
    """`one_device`'s loss and parameters, for one wrapped step on 2 ranks."""
    net = build()
    x, y = X.clone(), Y.clone()
    with simulated_world(2) as world:
        world.replicate(net)
        if megatron:  # (column- then row-parallel)
            sw.shard(net[0], in_strategy=((1, 1), (2, 1)))
            sw.shard(net[2], in_strategy=((1, 2), (1, 2)))
        step = sw.AutoParallel(stepper(net, loss_of), parallel_mode=mode)
        loss = step(world.rows(x), world.rows(y))
        return loss, {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize(("mode", "megatron"), MODES)
def test_an_input_gradient_used_in_the_loss_is_refused(mode: str, megatron: bool) -> None:
    with pytest.raises(
        CaptureError,
        match=r"torch.Tensor.sum at .*:\d+ computes with the gradient of requires_grad "
        r"\(the output of torch.Tensor.requires_grad_ at .*"
        r"torch.autograd.grad\(\.\.\., retain_graph=True\).*"
        r"its rows.*monitoring only.*parallel_mode=\"data_parallel\"",
    ):
        parallel(saliency_loss, mode, megatron)


def test_an_input_gradient_used_in_the_loss_runs_under_data_parallel() -> None:
    want = one_device(saliency_loss)
    assert_matches_single_device(parallel(saliency_loss, "data_parallel"), want)


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_a_parameter_gradient_used_in_the_loss_trains_as_one_device(mode: str) -> None:
    want = one_device(weight_loss)
    assert_matches_single_device(parallel(weight_loss, mode), want)


def test_a_split_parameter_gradient_used_in_the_loss_trains_as_one_device() -> None:
    """Under the Megatron annotations the parameter's mid-step gradient is gathered whole (as
    the plan reads it): the loss and each rank's parameter blocks are one device's."""
    want_loss, want = one_device(weight_loss)
    loss, got = parallel(weight_loss, "semi_auto", megatron=True)
    assert_matches_single_device(loss, want_loss, what="loss")
    split = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # (the dim each split parameter splits)
    for n, p in got.items():
        if n not in split:
            assert_matches_single_device(p, want[n], what=n)
            continue
        whole, d = want[n], split[n]
        assert_matches_single_device(p, lambda r, w=whole, d=d: w.chunk(2, d)[r], what=n)


@pytest.mark.parametrize("kind", ["vmap(grad)", "vmap(jacrev)"])
@pytest.mark.parametrize(("mode", "megatron"), MODES)
def test_a_torch_func_transform_in_the_step_is_refused(
    kind: str, mode: str, megatron: bool
) -> None:
    def loss_of(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(net, a, b, kind)

    with pytest.raises(
        CaptureError,
        match=r"torch.func.vmap at test_mid_step_differentiation.py:\d+ runs the step's code "
        r"inside a torch.func \(functorch\) transform.*parallel_mode=\"data_parallel\".*"
        r"move the transform out of the wrapped step",
    ):
        parallel(loss_of, mode, megatron)


@pytest.mark.parametrize(("mode", "megatron"), MODES)
def test_autograd_functional_jvp_in_the_step_is_refused(mode: str, megatron: bool) -> None:
    def loss_of(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(net, a, b, "jvp")

    with pytest.raises(
        CaptureError,
        match=r"torch.autograd.functional.jvp at test_mid_step_differentiation.py:\d+ "
        r"differentiates inside the step.*parallel_mode=\"data_parallel\"",
    ):
        parallel(loss_of, mode, megatron)


@pytest.mark.parametrize("kind", ["vmap(grad)", "jvp"])
def test_per_sample_transforms_run_under_data_parallel(kind: str) -> None:
    def loss_of(net: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(net, a, b, kind)

    assert_matches_single_device(parallel(loss_of, "data_parallel"), one_device(loss_of))
