"""What a wrapped train step returns besides its loss, and ops on it after ``loss.backward()``.

A Megatron MLP on 4 simulated ranks (dp 2 x mp 2): ``c_fc`` column parallel (its output split
over mp), ``c_proj`` row parallel (its output a partial sum over mp). A train step that returns
those activations gets each as this rank's rows of the single-device value, as a wrapped
network's outputs (the whole under ``"full_batch"``, the step's inputs too): the partial sum
all-reduced over mp, the columns moved to rows, rows over dp cut to rows over every rank; in a
plain dataclass too, and a value returned twice is moved once. The step's value fed back into
the next call (a recurrent state carried between steps) trains as one device, with the opt-in
fast paths too. An op after the backward on such a value runs outside the plan: one right on
this rank's part keeps it leaving the same way (``detach``, ``* 2``; on the partial sum only
linear ones); any other (``argmax``, ``+ 1`` or ``relu`` of the partial sum, ``tolist``) is
refused, naming the node; the same op before the backward is planned and right. Under data
parallel nothing is sent, and an op after the backward on a whole value the plan made is not
refused.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import AutoParallel, UnsupportedParallelError
from shardwise.planner import PlanError
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
            ("ReduceScatter", "forward", mp): 1,  # out's sum, to rows for the loss
            ("AllReduce", "forward", mp): 2,  # out and 2 out on return
            ("AllReduce", "forward", every): 1,  # the loss
            ("AllGather", "backward", mp): 1,  # the ReduceScatter's adjoint
            ("AllReduce", "backward", dp): 1,  # the mp-split parameters' bucket
            ("AllReduce", "backward", every): 1,  # c_proj's bias (whole)
        }
    ), kinds


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    mixed: torch.Tensor
    wide: torch.Tensor
    pair: tuple[torch.Tensor, torch.Tensor]


def linear_after(net: nn.Sequential, x: torch.Tensor) -> Out:
    """Linear ops on c_proj's partial sum after backward, returned in a plain dataclass, with
    the value itself twice in a tuple field."""
    out = net(x)
    loss = out.pow(2).mean()
    loss.backward()
    o = out.detach()
    return Out(loss, (o * 2 - 0.5 * o) / 4, o.double(), (o, o))


def test_linear_ops_on_a_partial_sum_after_backward_keep_it_leaving_as_rows() -> None:
    x = batch()
    want = linear_after(make_net(), x)
    got, kinds = run(linear_after, x)
    pair = got.pair
    assert_matches_single_device(got.loss, want.loss, what="loss")
    assert_matches_single_device(got.mixed, rows_of(want.mixed), what="(2 o - o / 2) / 4")
    assert_matches_single_device(got.wide, rows_of(want.wide), what="o.double()")
    assert pair[0] is pair[1]  # (moved once)
    assert_matches_single_device(pair[0], rows_of(want.wide.float()), what="o")
    # the loss's move for the mean (summed to rows: a ReduceScatter), then one AllReduce each
    # for mixed, wide and o
    assert kinds[("ReduceScatter", "forward", (0, 1))] == 1, kinds
    assert kinds[("AllReduce", "forward", (0, 1))] == 3, kinds


def test_full_batch_returns_the_whole_value() -> None:
    x = batch()
    want = hidden_and_out(make_net(), x)
    (loss, h, out, _), _ = run(hidden_and_out, x, "full_batch")
    assert_matches_single_device(loss, want[0], what="loss")
    assert_matches_single_device(h, want[1], what="h")
    assert_matches_single_device(out, want[2], what="out")


def inputs_after(net: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's own input returned as it is, and an op on it after the backward."""
    loss = net(x).pow(2).mean()
    loss.backward()
    return loss, x, x * 2


def test_full_batch_returns_the_inputs_whole() -> None:
    """Under ``"full_batch"`` the plan cuts each input to this rank's rows at entry: the input
    returned as it is is the caller's tensor, ``x * 2`` after the backward leaves whole (each
    came back as this rank's rows, silently); ``x[:, :3]`` there is refused, naming the input,
    as on any value held as rows that leaves whole."""
    x = batch()
    want = inputs_after(make_net(), x)
    net, other = make_net(), make_net()
    with simulated_world(DP * MP) as world:
        world.replicate(net)
        megatron(net)
        parallel = AutoParallel(lambda x: inputs_after(net, x), network=net)
        parallel.dataset_strategy("full_batch")
        given = world.same(x)
        loss, back, twice = parallel(given)
        assert back is given
        assert_matches_single_device(loss, want[0], what="loss")
        assert_matches_single_device(twice, want[2], what="x * 2")

        def sliced(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
            net(x).pow(2).mean().backward()
            return x[:, :3]

        megatron(world.replicate(other))
        parallel = AutoParallel(lambda x: sliced(other, x), network=other)
        parallel.dataset_strategy("full_batch")
        with pytest.raises(UnsupportedParallelError, match="reads the output of the step's input"):
            parallel(world.same(x))


@pytest.mark.parametrize("watch_every_op", [True, False])
def test_a_returned_state_fed_to_the_next_call_trains_as_one_device(watch_every_op: bool) -> None:
    """The step's output (a partial sum in the plan) is the next call's input, for 3 calls; with
    the opt-in fast paths too (the executor then stays on the mode stack after the optimizer
    step while a value held otherwise lives, so the ``detach`` after it is seen)."""
    sw.set_auto_parallel_context(watch_every_op=watch_every_op)

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
    sw.reset_auto_parallel_context()


AFTER = {
    "argmax": lambda out: out.argmax(-1),
    "sum": lambda out: out.sum(),
    # elementwise, but not linear: each rank's part of the sum would add 1, square, round
    "+ 1": lambda out: out + 1,
    "relu": lambda out: out.relu(),
    "out * out": lambda out: out * out,
    "bfloat16": lambda out: out.bfloat16(),
    "+ a 0-d tensor": lambda out: out + torch.tensor(1.0),
    "to int64": lambda out: (out * 10).to(torch.int64),  # (each rank's part rounded)
    "floor division": lambda out: out.div(0.25, rounding_mode="floor"),
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
    """Unannotated (every op data parallel): the activations are already this rank's rows; a
    whole value the plan made (a normalized weight) may be read after the backward."""
    x = batch()
    single = make_net()
    want = single(x)
    net = make_net()
    with simulated_world(4) as world:
        world.replicate(net)

        def step(x: torch.Tensor) -> Any:
            out = net(x)
            w = F.normalize(net[0].weight, dim=-1)  # (whole on every rank: a node of the plan)
            loss = out.pow(2).mean()
            loss.backward()
            return loss, out.detach().argmax(-1), out, w.norm(dim=-1).mean()

        parallel = AutoParallel(step, network=net)
        with CommRecorder() as rec:
            _, pred, out, norm = parallel(world.rows(x))
        assert rec.kinds() == Counter(
            {("AllReduce", "forward", (0, 1, 2, 3)): 1, ("AllReduce", "backward", (0, 1, 2, 3)): 1}
        ), rec.summary()
        assert_matches_single_device(out, rows_of(want.detach()), what="out")
        assert_matches_single_device(pred, rows_of(want.argmax(-1)), what="argmax")
        # (an op after backward on a whole value is right on every rank: not refused)
        assert_matches_single_device(norm, torch.tensor(1.0), what="the rows' mean norm")


def test_an_in_place_change_made_in_a_moved_copy_is_what_later_ops_read() -> None:
    """``out.clamp_(min=0)`` as a statement on c_proj's partial sum: the plan reduces ``out``
    first, so the clamp changes the moved copy; the ops after it, and the step's return, read
    the network's own ``out`` and get that copy (before: the unclamped partial sum, loss
    0.04539 against one device's 0.04641, silently)."""

    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = net(x)
        out.clamp_(min=0)
        loss = out.pow(2).mean()
        loss.backward()
        return loss, out.detach()

    x = batch()
    want = step(make_net(), x)
    (loss, out), _ = run(step, x)
    assert_matches_single_device(loss, want[0].detach(), what="loss")
    assert_matches_single_device(out, rows_of(want[1]), what="the clamped out")


def test_an_accumulator_changed_in_place_by_statements_matches_one_device() -> None:
    """``acc = torch.zeros(B, D); acc.add_(h); acc.add_(2 * h)`` under data parallel: the
    whole accumulator is cut to this rank's rows for the first ``add_`` (a move), and every
    later read of ``acc`` gets those rows (before: a shape error)."""
    torch.manual_seed(0)
    single, net = make_net(), make_net()

    def step_of(model: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(model[0](x))
            acc = torch.zeros(BATCH, 2 * D)
            acc.add_(h)
            acc.add_(h * 2)
            loss = model[2](acc).pow(2).mean()
            loss.backward()
            return loss

        return step

    x = batch()
    want = step_of(single)(x)
    with simulated_world(4) as world:
        world.replicate(net)
        loss = AutoParallel(step_of(net), network=net)(world.rows(x))
        assert_matches_single_device(loss, want.detach(), what="loss")
        grads = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(
            grads, {n: p.grad for n, p in single.named_parameters()}, what="grads"
        )


def test_an_in_place_op_no_rule_runs_on_a_partial_sum_names_the_out_of_place_form() -> None:
    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = F.relu(net(x), inplace=True)
        loss = out.pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(PlanError, match=r"in-place.*Fix: write it out of place"):
        run(step, batch())


def test_an_in_place_op_that_needs_no_move_runs() -> None:
    """``mul_`` of a partial sum is a partial sum: no move, the change stays in the tensor."""

    def step(net: nn.Sequential, x: torch.Tensor) -> Any:
        out = net(x)
        out.mul_(2)
        loss = out.pow(2).mean()
        loss.backward()
        return loss

    x = batch()
    want = step(make_net(), x)
    loss, _ = run(step, x)
    assert_matches_single_device(loss, want.detach(), what="loss")


def test_item_assignment_that_needs_a_move_names_its_out_of_place_forms() -> None:
    """``z[:, idx] = v`` on features a column-parallel layer split: the fix names the item
    assignment's out-of-place forms (torch.where, index_copy, scatter), not F.relu's."""

    class Written(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = sw.shard(nn.Linear(8, 8), in_strategy=((1, 1), (4, 1)))
            self.v = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.lin(x).clone()
            z[:, torch.tensor([1, 3, 6])] = self.v
            return z.pow(2).mean()

    net, x = Written(), torch.ones(8, 8)
    with simulated_world(4) as world:
        world.replicate(net)
        with pytest.raises(PlanError, match=r"Fix: write it out of place \(x = torch.where"):
            AutoParallel(net)(world.rows(x))
