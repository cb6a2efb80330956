"""`SimulatedWorld.replicate` keeps what the module shares: a tied parameter stays one
Parameter, a buffer keeps its persistence; an optimizer built before it is refused at its step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(3.0), persistent=False)
        self.register_buffer("count", torch.zeros(()))


def test_tied_parameter_stays_one() -> None:
    net = Tied()
    want = net.embed.weight.detach().clone()
    with simulated_world(2) as world:
        world.replicate(net)
        assert net.head.weight is net.embed.weight
        assert len(list(net.parameters())) == 1
        assert [torch.equal(w, want) for w in world.local_tensors(net.head.weight)] == [True] * 2


def test_buffers_keep_persistence() -> None:
    net = Tied()
    with simulated_world(2) as world:
        world.replicate(net)
        assert set(net.state_dict()) == {"embed.weight", "head.weight", "count"}
        assert world.local_tensors(net.table)[1].tolist() == [0.0, 1.0, 2.0]


def test_a_deferred_network_is_refused_and_left_to_autoparallel() -> None:
    """replicate() of meta parameters was accepted and the first call failed in torch ("Tensor
    on device meta is not on the expected device cpu") naming neither (a helper review)."""
    with sw.no_init_parameters():
        net = torch.nn.Linear(8, 8)
    x = torch.zeros(4, 8)
    with simulated_world(2) as world:
        with pytest.raises(ValueError, match=r"replicate: weight .* under sw.no_init_parameters"):
            world.replicate(net)
        out = sw.AutoParallel(net)(world.rows(x))
        assert out.shape == (2, 8)


def test_an_optimizer_built_before_replicate_is_refused_at_its_step() -> None:
    """An optimizer built before replicate() holds the parameters replicate replaced: its steps
    updated those, which the network no longer uses, and the loss stayed the same, silently (a
    helper probe). Its step is a ValueError naming the optimizer, the parameter and the fix;
    one built after trains, and the check goes with the world."""
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    net = nn.Linear(4, 2)
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    with simulated_world(2) as world:
        world.replicate(net)
        nn.functional.mse_loss(net(world.rows(x)), world.rows(y)).backward()
        with pytest.raises(ValueError, match=r"SGD\.step: .*'weight' \(shape \[2, 4\]\) .*build "
                           r"optimizers after world\.replicate\(net\)"):  # fmt: skip
            early.step()
        step = sw.AutoParallel(lambda a, b: _sgd_step(net, early, a, b))
        with pytest.raises(ValueError, match=r"SGD\.step: .*build optimizers after"):
            step(world.rows(x), world.rows(y))
        late = torch.optim.SGD(net.parameters(), lr=0.1)
        before = world.local(net.weight, 1).clone()
        late.step()
        assert not torch.equal(world.local(net.weight, 1), before)
    early.step()  # (outside the world: no check left behind)


def _sgd_step(
    net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
