"""Tensor attributes that are ops: ``.data``, ``.real`` and ``.imag`` (as ``.T`` / ``.mT``).

Their getters were taken for plain attribute reads, neither captured nor placed: the network
got the rank's raw local tensor, so ``w.data.norm()`` of a column-parallel weight (or of an
hsdp shard) was its block's norm, ``h.data.abs().mean()`` of a batch-split activation its
rows' mean, and ``z.real.pow(2).mean()`` of a complex activation split on the batch each rank's
own rows' loss, all silently. Now each is a node placed like any op: ``.data`` as the detached
value (``detach()``'s program: placed as its input, no gradient; an in-place op on it changes
the value as placed, the buffer or parameter itself where the plan keeps it so), ``.real`` /
``.imag`` as views of the complex value (``view_as_real`` and ``select``). Under hsdp an
in-place change of a parameter through such a view in the forward (``p.data.clamp_``,
``p.detach().zero_()``), which reached only the gathered copy, is refused like ``p.clamp_``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.parallel.test_dtype_changes import matches_by_blocks
from torch import nn

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(1)
BATCHES = [
    (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)
]


class Net(nn.Module):
    """Two linears; `forward_of` computes the loss from them (`how`)."""

    def __init__(self, how: str, column_parallel: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.randn(8, dtype=torch.complex64))
        self.register_buffer("run", torch.zeros(8))
        if column_parallel:  # (Megatron: l1's weight rows and bias split)
            sw.shard(self.l1, in_strategy=((1, 1), (column_parallel, 1)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.how == "weight.data":  # (a weight-norm style scale, no gradient through it)
            h = h / self.l1.weight.data.norm()
        if self.how == "activation.data":
            h = h * h.data.abs().mean()
        if self.how == "buffer.data":  # (a running mean kept through .data)
            self.run.data.mul_(0.5).add_(h.data.mean(0), alpha=0.5)
            h = h + self.run
        if self.how in ("real", "imag"):
            z = h.to(torch.complex64) * self.gain
            part = z.real if self.how == "real" else z.imag
            return part.pow(2).mean() + F.cross_entropy(self.l2(h), y)
        return F.cross_entropy(self.l2(F.relu(h)), y)


def stepper(net: nn.Module, grads: list[dict[str, torch.Tensor]] | None = None) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = net(x, y)
        loss.backward()
        if grads is not None:
            got = net.named_parameters()
            grads.append({n: p.grad.clone() for n, p in got if p.grad is not None})
        opt.step()
        opt.zero_grad()
        for p in net.parameters():  # (WGAN's weight clipping, after the update)
            if not p.is_complex():
                p.data.clamp_(-0.3, 0.3)
        return loss

    return step


def single_device(how: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], Net]:
    ref = Net(how)
    grads: list[dict[str, torch.Tensor]] = []
    one = stepper(ref, grads)
    return [one(x, y).detach() for x, y in BATCHES], grads, ref


CASES = [
    ("weight.data", 2, 2),
    ("weight.data", 4, 4),
    ("activation.data", 2, 0),
    ("activation.data", 4, 2),
    ("buffer.data", 2, 0),
    ("buffer.data", 4, 2),
    ("real", 2, 0),
    ("imag", 4, 2),
]


@pytest.mark.parametrize(("how", "ranks", "column_parallel"), CASES)
def test_attribute_ops_train_as_one_device(how: str, ranks: int, column_parallel: int) -> None:
    losses, grads, ref = single_device(how)
    net = Net(how, column_parallel)
    seen: list[dict[str, torch.Tensor]] = []
    with simulated_world(ranks) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net, seen), parallel_mode="semi_auto")
        got = [parallel(world.rows(x), world.rows(y)) for x, y in BATCHES]
        plan = parallel.parallel_plan
        assert plan is not None
        matches_by_blocks(plan, (got, seen, net), (losses, grads, ref))
        assert_matches_single_device(net.run, ref.run, what="run")


@pytest.mark.parametrize("level", ["level1", "level3"])
@pytest.mark.parametrize("how", ["weight.data", "real"])
def test_attribute_ops_under_hsdp_train_as_one_device(how: str, level: str) -> None:
    losses, _, _ = single_device(how)
    net = Net(how)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        got = [parallel(world.rows(x), world.rows(y)) for x, y in BATCHES]
        for i, (loss, want) in enumerate(zip(got, losses, strict=True)):
            assert_matches_single_device(loss, want, what=f"loss {i}")


class Clipped(nn.Module):
    """Clips its weight in place in the forward, through `view` (``.data`` or ``detach()``)."""

    def __init__(self, view: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.view = view
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight.data if self.view == "data" else self.lin.weight.detach()
        w.clamp_(-0.2, 0.2)
        return F.cross_entropy(self.lin(x), y)


@pytest.mark.parametrize("view", ["data", "detach"])
def test_a_weight_changed_through_a_view_in_the_forward_under_hsdp_is_refused(view: str) -> None:
    """Each rank stores a shard and the forward computes with a gathered copy, which alone the
    change would reach (``detach()``'s was lost silently): refused as ``p.clamp_`` is."""
    net = Clipped(view)
    x, y = BATCHES[0]
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level="level3")
        with pytest.raises(UnsupportedParallelError, match=r"clamp_ at .* changes parameter lin"):
            for _ in range(2):
                parallel(world.rows(x), world.rows(y))


@pytest.mark.parametrize("view", ["data", "detach"])
def test_a_weight_changed_through_a_view_in_the_forward_trains_as_one_device(view: str) -> None:
    ref, net = Clipped(view), Clipped(view)
    one = stepper(ref)
    losses = [one(x, y).detach() for x, y in BATCHES]
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")
        got = [parallel(world.rows(x), world.rows(y)) for x, y in BATCHES]
        for i, (loss, want) in enumerate(zip(got, losses, strict=True)):
            assert_matches_single_device(loss, want, what=f"loss {i}")
        assert_matches_single_device(net.lin.weight.detach(), ref.lin.weight.detach(), what="w")


@pytest.mark.parametrize("how", ["data", "real"])
def test_an_attribute_op_after_the_backward_leaves_as_the_rows(how: str) -> None:
    """After ``loss.backward()`` (outside the plan) ``out.data`` / ``out.real`` of a
    row-parallel layer's partial sum leaves the call as this rank's rows of one device's value,
    as ``out.detach()`` does (the partial sum's block was returned)."""

    def build(megatron: bool) -> nn.Sequential:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        if megatron:
            sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
            sw.shard(net[2], in_strategy=((2, 2), (1, 2)))
        return net

    def stepper(net: nn.Module) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = net(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out.data if how == "data" else out.to(torch.complex64).real

        return step

    x, y = BATCHES[0]
    want = stepper(build(False))(x, y)[1].detach()
    net = build(True)
    with simulated_world(4) as world:
        world.replicate(net)
        _, got = sw.AutoParallel(stepper(net), parallel_mode="semi_auto")(
            world.rows(x), world.rows(y)
        )
        assert_matches_single_device(got, lambda r: want[2 * r : 2 * r + 2], what=how)
