"""`SimulatedWorld.replicate` keeps what the module shares: a tied parameter stays one
Parameter, a buffer keeps its persistence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
    import shardwise as sw

    with sw.no_init_parameters():
        net = torch.nn.Linear(8, 8)
    x = torch.zeros(4, 8)
    with simulated_world(2) as world:
        with pytest.raises(ValueError, match=r"replicate: weight .* under sw.no_init_parameters"):
            world.replicate(net)
        out = sw.AutoParallel(net)(world.rows(x))
        assert out.shape == (2, 8)
