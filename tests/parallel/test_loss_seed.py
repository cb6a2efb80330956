"""The loss's AllReduce in backward, under `AutoParallel` on simulated ranks.

A data-parallel loss is made whole by one AllReduce (`sum_over_ranks`). When the train step
calls ``loss.backward()`` on it, the seed of backward is ones on every rank, so the adjoint
AllReduce would only multiply it by the group size: shardwise multiplies locally and sends
nothing. So it does from a root the plan computes from the loss with ops alike on every rank
(``(2 * loss).backward()``, ``loss / accumulation_steps``). A root made from something each
rank holds differently (a sum over its rows), made after the plan, or an explicit gradient
keeps the AllReduce.
In every case the loss and the gradients equal one device's, and the collectives are exactly
the loss's forward AllReduce plus one gradient AllReduce per backward (the four parameters'
gradients in one bucket) (plus the loss's backward AllReduce where the seed is not known to be
the same on every rank).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.communication.primitives import replicated_seed, sum_over_ranks
from shardwise.parallel import AutoParallel
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

BATCH, D_IN, HIDDEN, CLASSES = 12, 6, 5, 3

Backward = Callable[[torch.Tensor, torch.Tensor], object]
# how the train step runs backward (from the loss and this rank's input rows) -> whether the
# loss's backward still all-reduces
BACKWARDS: dict[str, tuple[Backward, int]] = {
    "loss.backward()": (lambda loss, x: loss.backward(), 0),
    "loss.backward(retain_graph) twice": (
        lambda loss, x: (loss.backward(retain_graph=True), loss.backward()),
        0,
    ),
    # the mark lasts one backward: the second, from a root made after the plan, all-reduces
    "loss.backward(retain_graph) twice, then scaled": (
        lambda loss, x: (loss.backward(retain_graph=True), (2 * loss).backward()),
        1,
    ),
    # a plan op alike on every rank reads the loss (`EdgePlan.seeded`): the seed stays equal
    "(2 * loss).backward()": (lambda loss, x: (2 * loss).backward(), 0),
    "(loss / 4 + 1).backward()": (lambda loss, x: (loss / 4 + 1).backward(), 0),
    # times the sum over all rows (a scalar: made whole at once, then read alike): equal
    "(loss * x.sum()).backward()": (lambda loss, x: (loss * x.sum()).backward(), 0),
    # times each rank's rows, then summed: the loss's gradient differs by rank
    "(loss * x).sum().backward()": (lambda loss, x: (loss * x).sum().backward(), 1),
    "loss.backward(gradient)": (lambda loss, x: loss.backward(torch.full((), 0.5)), 1),
}


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("how", list(BACKWARDS))
def test_loss_backward_all_reduces_only_when_the_seed_may_differ(how: str, world_size: int) -> None:
    run, loss_backward_all_reduces = BACKWARDS[how]
    x, y = batch()
    single = make_net()
    want_loss = F.cross_entropy(single(x), y)
    run(want_loss, x)
    want_grads = {n: p.grad for n, p in single.named_parameters()}

    net = make_net()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        run(loss, x)
        return loss

    ranks = tuple(range(world_size))
    passes = 2 if "twice" in how else 1
    comms = Counter(
        {
            ("AllReduce", "forward", ranks): 2 if "x" in how else 1,  # (and the sum's)
            # the 4 per-parameter gradient AllReduces of each backward are one bucket now
            ("AllReduce", "backward", ranks): passes + loss_backward_all_reduces,
        }
    )
    with simulated_world(world_size) as world:
        world.replicate(net)
        parallel = AutoParallel(step)
        with CommRecorder() as rec:
            loss = parallel(world.rows(x), world.rows(y))
        assert rec.kinds() == comms, rec.summary()
        assert_matches_single_device(loss, want_loss, what="loss")
        got = {n: p.grad for n, p in net.named_parameters()}
        assert_matches_single_device(got, want_grads, what="grads")


@pytest.mark.parametrize("divisor", [1, 4])
def test_sum_over_ranks_seeded_backward_is_the_group_size_times_the_seed(divisor: int) -> None:
    """Directly: inside `replicated_seed` the result's backward gives the seed x group size /
    divisor (what the AllReduce of equal seeds gives) with no collective; after the block, or
    unmarked, the AllReduce runs."""
    with simulated_world(4):
        for marked in (True, False):
            x = torch.ones(3).requires_grad_()  # (a world's tensors hold every rank's value)
            with CommRecorder() as rec:
                out = sum_over_ranks(x.sum(), None, divisor)
                if marked:
                    with replicated_seed(out) as known:
                        assert known
                        out.backward(retain_graph=True)
                    out.backward()  # the mark ended with the block: all-reduced
                else:
                    out.backward()
            assert rec.count("AllReduce", "backward") == 1, rec.summary()
            want = torch.full((3,), 4 / divisor) * (2 if marked else 1)
            assert_matches_single_device(x.grad, want, what="grad")
    with replicated_seed(torch.ones(2, requires_grad=True).sum()) as known:
        assert not known  # not a sum over ranks


def test_a_seeded_adjoint_belongs_to_its_own_run() -> None:
    """The mark names the run of the plan that made it: a value another wrapper returned (its
    mean made whole, then only doubled: seeded there) and read by this step's split rows keeps
    its AllReduce in this step's ``loss.backward()`` (the gradient it gets differs by rank)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, generator=g)

    def nets() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Linear(3, 1), nn.Linear(3, 1)

    a, b = nets()
    ((b(x).squeeze(-1) * (a(x).mean() * 2)).mean()).backward()
    want = {f"a.{n}": p.grad for n, p in a.named_parameters()}
    want |= {f"b.{n}": p.grad for n, p in b.named_parameters()}
    a, b = nets()

    def step(rows: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        loss = (b(rows).squeeze(-1) * h).mean()
        loss.backward()
        return loss

    with simulated_world(2) as world:
        world.replicate(a)
        world.replicate(b)
        first = AutoParallel(lambda rows: a(rows).mean() * 2)
        second = AutoParallel(step)
        second(world.rows(x), first(world.rows(x)))
        plan = first.parallel_plan
        assert plan is not None and any(e.seeded for e in plan.edges)
        got = {f"a.{n}": p.grad for n, p in a.named_parameters()}
        got |= {f"b.{n}": p.grad for n, p in b.named_parameters()}
        assert_matches_single_device(got, want, what="grads")


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_seed_made_from_python_data(world_size: int) -> None:
    """``loss.backward(torch.tensor(0.5))`` on a mean over split rows: the seed, a constant
    made from Python data (in a simulated world a plain tensor, one value on every rank as in
    a job), gives one device's gradients (the simulated world gave 1/N^2-like ones)."""
    x, _ = batch()
    single = make_net()
    single(x).mean().backward(torch.tensor(0.5))
    want = {n: p.grad for n, p in single.named_parameters()}
    net = make_net()

    def step(rows: torch.Tensor) -> torch.Tensor:
        loss = net(rows).mean()
        loss.backward(torch.tensor(0.5))
        return loss

    with simulated_world(world_size) as world:
        world.replicate(net)
        AutoParallel(step)(world.rows(x))
        assert_matches_single_device({n: p.grad for n, p in net.named_parameters()}, want)
