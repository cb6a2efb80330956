"""A seeded ``sw.ops.Dropout`` (one drawing from its own generator) inside activation
checkpointing, reentrant or not.

Torch's checkpoint puts back only the global generators' state for the recomputation; the op's
own generator went on, so the recomputation drew another mask and the gradients were those of
a mask the forward never used (75% off on one device, 84% under AutoParallel, the loss still
right). The recomputation now draws the forward's mask again and leaves the op's stream where
the forward left it: losses and gradients equal the same network without checkpointing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

from ..zoo import recording_step

STEPS, MP = 2, 2
pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    """MatMul, then ReLU and the seeded Dropout twice (in a checkpointed region when `how`
    says so), then MatMul; Megatron-like strategies on a (2, 2) matrix when `sharded`."""

    def __init__(self, how: str = "", sharded: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 32, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(32, 8, generator=g) * 0.2)
        self.mm1, self.relu, self.mm2 = sw.ops.MatMul(), sw.ops.ReLU(), sw.ops.MatMul()
        self.drop = sw.ops.Dropout(0.6, Seed0=3, Seed1=5)
        if sharded:  # (w1 split by columns, w2 by rows, over the second axis)
            self.mm1.shard(((2, 1), (1, MP)))
            self.relu.shard(((2, MP),))
            self.drop.shard(((2, MP),))
            self.mm2.shard(((2, MP), (MP, 1)))
        self.how = how

    def region(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.drop(self.relu(h))[0])[0]  # (two draws)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mm1(x, self.w1)
        if self.how:
            h = checkpoint(self.region, h, use_reentrant=self.how == "reentrant")
        else:
            h = self.region(h)
        out: torch.Tensor = self.mm2(h, self.w2)
        return out


def mse(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x), y)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def train(net: Net, seen: list[dict[str, torch.Tensor]]) -> Any:
    return recording_step(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, seen)


def one_device(how: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    (x, y), grads = data(), []
    step = train(Net(how), grads)
    return [step(x, y).detach() for _ in range(STEPS)], grads


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_one_device_checkpointed_gradients_are_the_true_ones(how: str) -> None:
    """Two steps: the second's masks are those after the first's (the recomputation leaves the
    op's stream where the forward left it)."""
    want, want_grads = one_device("")
    got, grads = one_device(how)
    for s in range(STEPS):
        assert_matches_single_device(got[s], want[s], what=f"loss {s}")
        assert_matches_single_device(grads[s], want_grads[s], what=f"grads {s}")


def block(full: torch.Tensor, dim: int) -> Any:
    """Rank -> its block of `full`, cut in MP along `dim` by the rank's second-axis index."""
    return lambda rank: full.chunk(MP, dim)[rank % MP]


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_auto_parallel_checkpointed_gradients_are_the_true_ones(how: str) -> None:
    """4 simulated ranks: each rank's gradient blocks are those of one device without
    checkpointing; the recomputation runs no collective (its ops are local)."""
    want, want_grads = one_device("")
    (x, y), seen, net = data(), [], Net(how, sharded=True)
    with simulated_world(4) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(train(net, seen), parallel_mode="semi_auto")
        with CommRecorder() as rec:
            for s in range(STEPS):
                loss = parallel(world.rows(x), world.rows(y))
                assert_matches_single_device(loss, want[s], what=f"loss {s}")
                g1, g2 = want_grads[s]["w1"], want_grads[s]["w2"]
                assert_matches_single_device(seen[s]["w1"], block(g1, 1), what=f"w1.grad {s}")
                assert_matches_single_device(seen[s]["w2"], block(g2, 0), what=f"w2.grad {s}")
    assert not [r for r in rec.records if r.label.startswith("recompute")], rec.summary()
    mp, dp, world_ranks = (0, 1), (0, 2), (0, 1, 2, 3)  # (rank 0's groups)
    assert rec.kinds() == Counter(
        {
            ("AllGather", "forward", mp): STEPS,  # (x's rows, whole for mm1's (2, 1))
            ("AllReduce", "forward", mp): STEPS,  # (mm2's contraction over the mp axis)
            ("AllReduce", "forward", world_ranks): STEPS,  # (the mean loss)
            ("AllReduce", "backward", mp): STEPS,  # (x's gradient through mm1, w1 split)
            ("AllReduce", "backward", dp): STEPS,  # (the gradient bucket over dp)
        }
    ), rec.summary()
