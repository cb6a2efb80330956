"""``nn.Embedding(scale_grad_by_freq=True)`` on ids split over ranks: each row's gradient is
divided by how often its id occurs in the batch, and each rank counted only its own rows' ids,
so the summed gradient of a repeated id was n times one device's (exactly 2x at 2 ranks, 4x at
4). Its rule (`ops.torch_rules.embedding_rule`) runs the op on the whole ids: the loss and
every gradient equal one device's. With ``max_norm`` (rows rescaled in place by their norm over
the whole embedding dim) an annotation splitting the embedding dim is refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.planner import PlanError
from shardwise.testing import simulated_world

from ..zoo import recording_step, semi_auto_matches

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(16, 8, scale_grad_by_freq=True)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.wte(ids)))
        return out


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("world_size", [2, 4])
def test_scale_grad_by_freq_on_split_ids_trains_as_one_device(world_size: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)
    x[:, 0] = 3  # (id 3 in every row: its count spans the ranks)
    ref = TinyLM()
    grads: list[dict[str, torch.Tensor]] = []
    step = recording_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss_of, grads)
    losses = [step(x, y).detach() for _ in range(2)]
    net = TinyLM()
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        semi_auto_matches(world, net, opt, loss_of, [(x, y)] * 2, losses, grads)


def test_max_norm_with_the_embedding_dim_split_names_max_norm() -> None:
    """``nn.Embedding(max_norm=...)`` rescales each looked-up row by its norm over the whole
    embedding dim: an annotation splitting that dim is refused naming max_norm and the fix
    (the generic message said only that the rule wants the weight whole)."""
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8, max_norm=1.0)
    net = nn.Sequential(emb, nn.Linear(8, 4))
    ids = torch.randint(0, 16, (4, 3))
    with simulated_world(2) as world:
        world.replicate(net)
        sw.shard(emb, in_strategy=((1, 1), (1, 2)))
        with pytest.raises(PlanError, match=r"max_norm=1\.0\).*whole embedding dim.*renormalize"):
            sw.AutoParallel(net)(world.rows(ids))
