"""One wrapped step that trains or evaluates, as a flag says: ``net.eval()`` and
``torch.no_grad()`` in its eval branch.

The eval branch has no backward; leaving ``torch.no_grad()`` after its last op is a call of
Python state (``torch._C._set_grad_enabled``), not an op the plan lacks. Before, it planned the
call again and then refused it ("called _set_grad_enabled after the plan's last op right after
being planned"). Now the step alternates training and evaluation on the Megatron MLP (dropout in
training) at dp 2 x mp 2, each call equal to one device's, each branch from its own plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world


def make() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 8))


def step_of(net: nn.Sequential, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def step(x: torch.Tensor, train: bool) -> torch.Tensor:
        if train:
            net.train()
            loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        net.eval()
        with torch.no_grad():
            return net(x).pow(2).mean()

    return step


def test_a_step_that_trains_or_evaluates_matches_one_device() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), train) for train in (True, False, True, False)]
    single = make()
    run = step_of(single, torch.optim.SGD(single.parameters(), lr=0.1))
    want = []
    for i, (x, train) in enumerate(batches):
        torch.manual_seed(10 + i)  # (the dropout's masks)
        want.append(run(x, train).detach())

    net = make()
    with simulated_world(4) as world:
        world.replicate(net)
        sw.shard(net[0], in_strategy=((2, 1), (2, 1)))
        sw.shard(net[3], in_strategy=((2, 2), (1, 2)))
        parallel = sw.AutoParallel(step_of(net, torch.optim.SGD(net.parameters(), lr=0.1)))
        for i, (x, train) in enumerate(batches):
            torch.manual_seed(10 + i)
            loss = parallel(world.rows(x), train)
            assert_matches_single_device(loss, want[i], what=f"call {i} (train={train})")


def test_dropout_masks_after_an_eval_call_are_one_devices() -> None:
    """A train branch that also computes its accuracy, called after an eval call: the call runs
    the eval branch's plan until the ops differ, then again from the state it started in; the
    random generators the dropout draws from were not put back (only the CPU's default one, not
    a simulated world's per-rank ones or an accelerator's): the masks differed from one
    device's from the second training call."""
    import torch.nn.functional as F

    def make_cls() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

    def cls_step(net: nn.Sequential) -> Callable[..., torch.Tensor]:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
            if not train:
                net.eval()
                with torch.no_grad():
                    return F.cross_entropy(net(x), y)
            net.train()
            logits = net(x)
            loss = F.cross_entropy(logits, y)
            (logits.argmax(-1) == y).float().mean()  # (the accuracy, computed and dropped)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))] * 3
    single_step = cls_step(make_cls())
    want = []
    for i, (x, y) in enumerate(data):
        torch.manual_seed(100 + i)
        want.append(single_step(x, y).detach())
        single_step(x, y, train=False)
    net = make_cls()
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(cls_step(net), parallel_mode="semi_auto")
        for i, (x, y) in enumerate(data):
            torch.manual_seed(100 + i)
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, want[i], what=f"training call {i}")
            parallel(world.rows(x), world.rows(y), train=False)
