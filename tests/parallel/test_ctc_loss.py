"""``F.ctc_loss`` / ``nn.CTCLoss`` cannot be captured: the shape of its output depends on the
target lengths' values. The CaptureError names it and the way to run it (the loss outside the
wrapped step, on the wrapped network's outputs; or data_parallel), and that way equals one
device (the loss, every gradient, the updated parameters).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import CaptureError
from shardwise.testing import assert_matches_single_device, simulated_world

WORLD = 2


class Acoustic(nn.Module):
    """Frames -> per-frame log-probabilities over 5 symbols (blank 0), batch first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(x), -1)


def data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 10, 6, generator=g)
    targets = torch.randint(1, 5, (8, 4), generator=g)
    inputs = torch.tensor([10, 9, 10, 8, 10, 7, 10, 10])
    lengths = torch.tensor([4, 3, 2, 4, 1, 3, 4, 2])
    return x, targets, inputs, lengths


def one_device() -> tuple[torch.Tensor, Acoustic]:
    x, targets, inputs, lengths = data()
    ref = Acoustic()
    loss = F.ctc_loss(ref(x).transpose(0, 1), targets, inputs, lengths, zero_infinity=True)
    loss.backward()
    return loss.detach(), ref


@pytest.mark.parametrize("form", ["function", "module"])
def test_ctc_loss_in_the_step_names_the_op_and_the_way_to_run_it(form: str) -> None:
    """It said to use 'a mask and torch.where instead of indexing by a boolean tensor'."""
    ctc = nn.CTCLoss(zero_infinity=True)
    net = Acoustic()
    rows = data()
    with simulated_world(WORLD) as world:
        world.replicate(net)

        def step(x: torch.Tensor, t: torch.Tensor, i: torch.Tensor, n: torch.Tensor) -> object:
            lp = net(x).transpose(0, 1)
            loss = F.ctc_loss(lp, t, i, n) if form == "function" else ctc(lp, t, i, n)
            loss.backward()
            return loss

        parallel = sw.AutoParallel(step)
        match = (
            r"ctc_loss at test_ctc_loss.py:\d+ cannot be captured .*target lengths.*compute the "
            r"loss outside the wrapped step: wrap the network \(parallel = sw.AutoParallel\(net\)"
            r".*sw.ops.AllReduce\(\)\(F.ctc_loss\(.*\)\) / n.*parallel_mode='data_parallel'"
        )
        with pytest.raises(CaptureError, match=match):
            parallel(*(world.rows(t) for t in rows))


def test_the_loss_outside_the_wrapped_network_matches_one_device() -> None:
    want, ref = one_device()
    x, targets, inputs, lengths = data()
    net = Acoustic()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net)
        lp = parallel(world.rows(x)).transpose(0, 1)  # (this rank's rows)
        mine = F.ctc_loss(
            lp, world.rows(targets), world.rows(inputs), world.rows(lengths), zero_infinity=True
        )
        loss = sw.ops.AllReduce()(mine) / WORLD
        loss.backward()
        assert_matches_single_device(loss, want, what="loss")
        assert_matches_single_device(
            {n: p.grad for n, p in net.named_parameters()},
            {n: p.grad for n, p in ref.named_parameters()},
            what="grads",
        )


def test_the_step_in_data_parallel_mode_matches_one_device() -> None:
    _, ref = one_device()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    net, rows = Acoustic(), data()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, t: torch.Tensor, i: torch.Tensor, n: torch.Tensor) -> object:
            loss = F.ctc_loss(net(x).transpose(0, 1), t, i, n, zero_infinity=True)
            loss.backward()
            opt.step()
            return loss

        parallel = sw.AutoParallel(step, parallel_mode="data_parallel")
        parallel(*(world.rows(t) for t in rows))
        assert_matches_single_device(
            {n: p.detach() for n, p in net.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
            what="updated parameters",
        )
