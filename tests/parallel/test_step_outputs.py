"""What a wrapped train step returns besides its loss, and ops on it after ``loss.backward()``.

A Megatron MLP on 4 simulated ranks (dp 2 x mp 2): ``c_fc`` column parallel (its output split
over mp), ``c_proj`` row parallel (its output a partial sum over mp). A train step that returns
those activations gets each as this rank's rows of the single-device value, as a wrapped
network's outputs (the whole under ``"full_batch"``): the partial sum all-reduced over mp, the
columns gathered over mp, rows over dp cut to rows over every rank. The step's value fed back
into the next call (a recurrent state carried between steps) trains as one device. An op after
the backward on such a value runs outside the plan: elementwise ones (``detach``, ``* 2``) keep
it leaving the same way; any other (``argmax``, ``tolist``) is refused, naming the node; the
same op before the backward is planned and right.
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
from shardwise.parallel import AutoParallel, UnsupportedParallelError
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, D = 8, 8
DP, MP = 2, 2


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))


def megatron(net: nn.Sequential) -> nn.Sequential:
    sw.shard(net[0], in_strategy=((DP, 1), (MP, 1)))  # columns of c_fc over mp
    sw.shard(net[2], in_strategy=((DP, MP), (1, MP)))  # rows of c_proj: a partial sum
    return net


def batch() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1))


def rows_of(t: torch.Tensor, n: int = DP * MP) -> Callable[[int], torch.Tensor]:
    return lambda rank: t.chunk(n)[rank]


Step = Callable[[nn.Sequential, torch.Tensor], Any]


def run(step: Step, x: torch.Tensor, dataset: str = "data_parallel") -> tuple[Any, Counter[Any]]:
    """`step` wrapped around the Megatron MLP on 4 simulated ranks, called on `x` (rows or
    whole as `dataset` says): its result and the collectives of the call."""
    net = make_net()
    with simulated_world(DP * MP) as world:
        world.replicate(net)
        megatron(net)
        parallel = AutoParallel(lambda x: step(net, x), network=net)
        parallel.dataset_strategy(dataset)
        with CommRecorder() as rec:
            out = parallel(world.rows(x) if dataset == "data_parallel" else world.same(x))
        return out, rec.kinds()


def hidden_and_out(net: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = net[1](net[0](x))
    out = net[2](h)
    loss = out.pow(2).mean()
    loss.backward()
    return loss, h.detach(), out.detach(), out.detach() * 2


def test_returned_activations_leave_as_this_ranks_rows() -> None:
    x = batch()
    want = hidden_and_out(make_net(), x)
    (loss, h, out, twice), kinds = run(hidden_and_out, x)
    assert_matches_single_device(loss, want[0], what="loss")
    for name, got, single in (("h", h, want[1]), ("out", out, want[2]), ("2 out", twice, want[3])):
        assert_matches_single_device(got, rows_of(single), what=name)
    mp, dp, every = (0, 1), (0, 2), (0, 1, 2, 3)  # (g1, g0: dp outer)
    assert kinds == Counter(
        {
            ("AllGather", "forward", mp): 1,  # the rows over dp for c_fc
            ("AlltoAll", "forward", mp): 1,  # on return: h's columns over mp -> rows
            ("AllReduce", "forward", mp): 3,  # out's sum for the loss; out and 2 out on return
            ("AllReduce", "forward", every): 1,  # the loss
            ("AllReduce", "backward", mp): 1,  # c_fc's input gradient (its adjoint)
            ("AllReduce", "backward", dp): 1,  # the mp-split parameters' bucket
            ("AllReduce", "backward", every): 1,  # c_proj's bias (whole)
        }
    ), kinds


def test_full_batch_returns_the_whole_value() -> None:
    x = batch()
    want = hidden_and_out(make_net(), x)
    (loss, h, out, _), _ = run(hidden_and_out, x, "full_batch")
    assert_matches_single_device(loss, want[0], what="loss")
    assert_matches_single_device(h, want[1], what="h")
    assert_matches_single_device(out, want[2], what="out")


def test_a_returned_state_fed_to_the_next_call_trains_as_one_device() -> None:
    """The step's output (a partial sum in the plan) is the next call's input, for 3 calls."""

    def step(net: nn.Sequential, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
        out = net(x)
        loss = F.mse_loss(out, torch.zeros_like(out))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, out.detach()

    single = make_net()
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    state, want = batch(), []
    for _ in range(3):
        loss, state = step(single, opt, state)
        want.append(loss)

    net, x = make_net(), batch()
    with simulated_world(DP * MP) as world:
        world.replicate(net)
        megatron(net)
        popt = torch.optim.SGD(net.parameters(), lr=0.5)
        parallel = AutoParallel(lambda x: step(net, popt, x), network=net)
        state = world.rows(x)
        for i in range(3):
            loss, state = parallel(state)
            assert_matches_single_device(loss, want[i], what=f"loss {i}")


AFTER = {
    "argmax": lambda out: out.argmax(-1),
    "sum": lambda out: out.sum(),
    # (a value read; called as torch's method: the simulated world's tensor has its own)
    "tolist": lambda out: torch.Tensor.tolist(out),
}


@pytest.mark.parametrize("after", list(AFTER))
def test_an_op_after_backward_on_a_value_held_otherwise_is_refused(after: str) -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = net(x)
        loss = out.pow(2).mean()
        loss.backward()
        return loss, AFTER[after](out.detach())  # (detach keeps it held as the partial sum)

    with pytest.raises(UnsupportedParallelError, match=r"%2 2/linear.*partial-sum\[g1\]"):
        run(step, batch())


def test_the_same_op_before_backward_is_planned() -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = net(x)
        pred = out.argmax(-1)
        loss = out.pow(2).mean()
        loss.backward()
        return loss, pred

    x = batch()
    want = make_net()(x).argmax(-1)
    (_, pred), _ = run(step, x)
    assert_matches_single_device(pred, rows_of(want), what="argmax")


def test_data_parallel_outputs_leave_with_no_collective() -> None:
    """Unannotated (every op data parallel): the activations are already this rank's rows."""
    x = batch()
    single = make_net()
    want = single(x)
    net = make_net()
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> Any:
            out = net(x)
            loss = out.pow(2).mean()
            loss.backward()
            return loss, out.detach().argmax(-1), out

        parallel = AutoParallel(step, network=net)
        with CommRecorder() as rec:
            _, pred, out = parallel(world.rows(x))
        assert rec.kinds() == Counter(
            {("AllReduce", "forward", (0, 1, 2, 3)): 1, ("AllReduce", "backward", (0, 1, 2, 3)): 1}
        ), rec.summary()
        assert_matches_single_device(out, rows_of(want.detach()), what="out")
        assert_matches_single_device(pred, rows_of(want.argmax(-1)), what="argmax")
