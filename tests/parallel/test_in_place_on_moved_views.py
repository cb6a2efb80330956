"""An in-place activation whose input the plan moves first, where the move hands over a view.

``nn.ReLU(inplace=True)`` (and ``F.relu_``) on a value the plan moves: by ``sw.shard``'s input
strategy on the ReLU (rows to columns, an AlltoAll: the moved block is a view made by the
collective's autograd Function) or, under sharding propagation, by its own edge (a Slice's
narrow of rows kept whole over 2 of 4 devices). torch refused the change with a RuntimeError
(``Output 0 of View is a view and is being modified inplace``), in a real job too. Now the op
on its own edge's move changes a fresh copy of the moved block (later reads of the network's
tensor get that copy), and loss, gradients and parameters after two SGD steps equal one
device's; a move by the module's ``sw.shard`` input strategy, whose change the network's own
tensor would not see, is refused at plan time with a `PlanError`.
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
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in "ab"]


class Relu_(nn.Module):
    """``F.relu_`` as a module (``sw.shard`` annotates modules), or of a view of its input."""

    def __init__(self, of_a_view: bool) -> None:
        super().__init__()
        self.of_a_view = of_a_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.of_a_view:
            F.relu_(x.view(-1, 4, 4))
            return x
        return F.relu_(x)


class Net(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True) if act == "ReLU(inplace=True)" else Relu_(act == "view")
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


def stepper(net: nn.Module, grads: list[dict[str, torch.Tensor]]) -> Any:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        return loss

    return step


def check(act: str, ranks: int, mode: str, annotate: Callable[[Net], None]) -> None:
    """Two steps of `Net(act)` on `ranks` simulated devices equal two on one device."""
    ref, want_grads = Net(act), []
    one = stepper(ref, want_grads)
    want = [one(x, y).detach() for x, y in DATA]
    net, seen = Net(act), []
    with simulated_world(ranks) as world:
        world.replicate(net)
        annotate(net)
        parallel = sw.AutoParallel(stepper(net, seen), parallel_mode=mode)
        got = [parallel(world.rows(x), world.rows(y)) for x, y in DATA]
        plan = parallel.parallel_plan
        assert plan is not None

        def block(name: str, full: torch.Tensor) -> Callable[[int], torch.Tensor]:
            layout = plan.params[name].layout
            return lambda r: full[layout.local_index(r, tuple(full.shape))]

        for i, (loss, expected) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(loss, expected, what=f"loss {i}")
            for name, full in want_grads[i].items():
                assert_matches_single_device(seen[i][name], block(name, full), what=f"grad {i}")
        for name, p in ref.named_parameters():
            got_p = net.get_parameter(name).detach()
            assert_matches_single_device(got_p, block(name, p.detach()), what=name)


def columns_for_the_relu(net: Net) -> None:
    sw.shard(net.fc1, in_strategy=((2, 1), (1, 1)))  # (rows over 2)
    sw.shard(net.act, in_strategy=((1, 2),))  # (the ReLU on columns: an AlltoAll)
    sw.shard(net.fc2, in_strategy=((1, 2), (1, 2)))  # (row parallel)


def rows_over_two_of_four(net: Net) -> None:
    sw.shard(net.fc1, in_strategy=((2, 1), (1, 1)))  # (rows over 2 of the 4 devices)
    sw.shard(net.fc3, in_strategy=((1, 1), (2, 1)))  # (a column-parallel head)


@pytest.mark.parametrize("act", ["ReLU(inplace=True)", "F.relu_", "view"])
def test_an_in_place_relu_on_an_input_its_annotation_moves_is_refused(act: str) -> None:
    """``sw.shard``'s input strategy moves the ReLU's input to columns; on one device the
    in-place ReLU changes the network's own tensor, which a later read (a residual) would see,
    but here it would change the moved copy: refused at plan time, naming the op (a clone of
    the moved block trained silently wrong as soon as the network read its tensor again)."""
    with pytest.raises(sw.planner.PlanError, match=r"changes a view of a value in place"):
        check(act, 2, "semi_auto", columns_for_the_relu)


@pytest.mark.parametrize("act", ["ReLU(inplace=True)", "F.relu_"])
def test_an_in_place_relu_on_rows_the_plan_slices_matches_one_device(act: str) -> None:
    check(act, 4, "sharding_propagation", rows_over_two_of_four)
