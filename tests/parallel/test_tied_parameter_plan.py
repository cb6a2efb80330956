"""``sw.shard(..., parameter_plan=...)`` naming a tied weight by its second name.

With ``head.weight = emb.weight`` (GPT-2 style), ``sw.shard(net.head, parameter_plan={"weight":
...})`` (or ``{"head.weight": ...}`` on the network) was refused as "not a parameter" (valid
names: ``[]``): the names were read from ``named_parameters()``, which lists a tied parameter
once, by its first name. Now every name of a parameter is accepted and the plan applies to the
one parameter: the network trains as one device. Two different entries for the one parameter
are a ValueError naming both names.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(2)
IDS = torch.randint(0, 16, (8, 4), generator=g)
TARGETS = torch.randint(0, 16, (8, 4), generator=g)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def trainer(net: Tied) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    opt = torch.optim.SGD(net.parameters(), lr=0.5)

    def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("where", ["submodule", "network"])
def test_a_plan_by_the_tied_name_trains_as_one_device(where: str) -> None:
    ref = Tied()
    one = trainer(ref)
    want = [one(IDS, TARGETS).detach() for _ in range(3)]
    net = Tied()
    if where == "submodule":
        sw.shard(net.head, in_strategy=None, parameter_plan={"weight": (2, 1)})
    else:
        sw.shard(net, in_strategy=None, parameter_plan={"head.weight": (2, 1)})
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net))
        got = [parallel(world.rows(IDS), world.rows(TARGETS)) for _ in range(3)]
        assert_matches_single_device(got, want, what="losses")
        assert tuple(net.emb.weight.shape) == (8, 8)  # (stored as the plan says: 8 of 16 rows)
        rows = ref.emb.weight.detach()
        assert_matches_single_device(net.emb.weight, lambda r: rows[8 * r : 8 * r + 8])
        assert net.head.weight is net.emb.weight


def test_two_entries_for_one_tied_parameter_are_refused() -> None:
    net = Tied()
    plan = {"emb.weight": (2, 1), "head.weight": (1, 2)}
    sw.shard(net, in_strategy=None, parameter_plan=plan)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(trainer(net))
        with pytest.raises(ValueError, match=r"'head\.weight'.*tied to 'emb\.weight'"):
            parallel(world.rows(IDS), world.rows(TARGETS))
