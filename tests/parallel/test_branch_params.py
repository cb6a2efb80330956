"""A flag that picks which module runs the same ops (an ``nn.ModuleDict`` of heads).

The plan executor matched each call to the plan's next node by its op only: a call picking
``heads["b"]`` ran heads.b's ``F.linear`` as the plan's heads.a node, with the moves planned for
heads.a's annotation (a shape error inside LocalTensor or ``redistribute``; a loss off by a
factor when the shapes fit: two Megatron heads of one shape, one annotated). A call now matches
a node only on the parameters it read: before a backward another head's call is planned again
(or takes that head's plan, also when Python state picks the head); after a backward (a step
training one head after another) it runs as the node when the other head's weights are stored
and reduced as the node's are, and is an `UnsupportedParallelError` naming both when not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel import UnsupportedParallelError
from shardwise.testing import assert_matches_single_device, simulated_world

WORLD = 2


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class Heads(nn.Module):
    """A trunk, then the head `forward` is given (or `head`, when given none)."""

    def __init__(self, heads: str = "ab", deep: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 8)
        self.heads = nn.ModuleDict({h: mlp() if deep else nn.Linear(8, 4) for h in heads})
        self.head = heads[0]

    def forward(self, x: torch.Tensor, head: str | None = None) -> torch.Tensor:
        out: torch.Tensor = self.heads[head or self.head](torch.tanh(self.fc1(x)))
        return out


def fc1_column_head_a_row(net: Heads) -> None:
    sw.shard(net.fc1, in_strategy=((1, 1), (WORLD, 1)))
    sw.shard(net.heads["a"], in_strategy=((1, WORLD), (1, WORLD)))


def head_a_column(net: Heads) -> None:
    sw.shard(net.heads["a"], in_strategy=((1, 1), (WORLD, 1)))


def head_a_megatron(net: Heads) -> None:  # (heads of one shape: heads.b's weights fit its blocks)
    head = net.heads["a"]
    assert isinstance(head, nn.Sequential)
    sw.shard(head[0], in_strategy=((1, 1), (WORLD, 1)))
    sw.shard(head[2], in_strategy=((1, WORLD), (1, WORLD)))


CASES: dict[str, tuple[Callable[[Heads], None], bool]] = {
    "fc1 column, head a row": (fc1_column_head_a_row, False),
    "head a column": (head_a_column, False),
    "megatron head a, same shapes": (head_a_megatron, True),
}


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def trainer(net: Heads) -> Callable[..., torch.Tensor]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor, head: str | None = None) -> torch.Tensor:
        loss = F.cross_entropy(net(x, head), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def one_device(net: Heads, calls: list[tuple[Any, ...]]) -> tuple[list[Any], dict[str, Any]]:
    step = trainer(net)
    losses = [step(*call).detach() for call in calls]
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def check_parameters(parallel: Any, net: Heads, want: dict[str, torch.Tensor]) -> None:
    """Each rank's parameter blocks against one device's (the stored plan's layouts)."""
    plan = parallel.parallel_plan
    assert plan is not None
    for name, p in net.named_parameters():
        layout, full = plan.params[name].layout, want[name]
        block = lambda r, f=full, lay=layout: f[lay.local_index(r, tuple(f.shape))]  # noqa: E731
        assert_matches_single_device(p.detach(), block, what=name)


@pytest.mark.parametrize("case", list(CASES))
def test_each_head_a_flag_picks_trains_as_one_device_on_its_own_plan(case: str) -> None:
    annotate, deep = CASES[case]
    calls = [(x, y, "ab"[i % 2]) for i, (x, y) in enumerate(data(4))]
    losses, want = one_device(Heads(deep=deep), calls)
    net = Heads(deep=deep)
    annotate(net)
    plans = []
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net), parallel_mode="semi_auto")
        for i, (x, y, head) in enumerate(calls):
            loss = parallel(world.rows(x), world.rows(y), head)
            assert_matches_single_device(loss, losses[i], what=f"loss {i} (head {head})")
            plans.append(parallel.parallel_plan)
        check_parameters(parallel, net, want)
    assert plans[2] is plans[0] and plans[3] is plans[1] and plans[0] is not plans[1]


def test_a_head_python_state_picks_takes_its_plan_or_a_new_one() -> None:
    """No flag: each call starts on the plan the last one ran and stops at the head; the plan
    kept for the head it meets is taken (matched on that head's weights, not only its op: the
    third head is planned, not run on the second head's plan)."""
    heads = "abcab"
    calls = [(x, y) for x, y in data(len(heads))]
    ref = Heads("abc", deep=True)
    step = trainer(ref)
    losses = []
    for head, call in zip(heads, calls, strict=True):
        ref.head = head
        losses.append(step(*call).detach())
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    net = Heads("abc", deep=True)
    head_a_megatron(net)
    plans = []
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net), parallel_mode="semi_auto")
        for i, (head, (x, y)) in enumerate(zip(heads, calls, strict=True)):
            net.head = head
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, losses[i], what=f"loss {i} (head {head})")
            plans.append(parallel.parallel_plan)
        check_parameters(parallel, net, want)
    assert len({id(p) for p in plans}) == 3
    assert plans[3] is plans[0] and plans[4] is plans[1]


def multitask(net: Heads) -> Callable[..., torch.Tensor]:
    """A step training head a, then head b (a backward each), then one optimizer step."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for head in "ab":
            loss = F.cross_entropy(net(x, head), y)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    return step


def test_a_pass_after_backward_on_a_head_stored_alike_runs_as_the_node() -> None:
    """The second head's pass cannot be planned (a backward ran): with both heads whole, it
    runs as the first head's nodes, as one device."""
    calls = data(2)
    ref = Heads()
    ref_step = multitask(ref)
    losses = [ref_step(x, y).detach() for x, y in calls]
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    net = Heads()
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(multitask(net), parallel_mode="semi_auto")
        for i, (x, y) in enumerate(calls):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, losses[i], what=f"loss {i}")
        check_parameters(parallel, net, want)


def test_a_pass_after_backward_on_a_head_stored_otherwise_is_an_error() -> None:
    net = Heads(deep=True)
    head_a_megatron(net)
    (x, y), _ = data(2)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(multitask(net), parallel_mode="semi_auto")
        match = r"heads\.b\.0\.weight.*heads\.a\.0\.weight.*same parameters"
        with pytest.raises(UnsupportedParallelError, match=match):
            parallel(world.rows(x), world.rows(y))
