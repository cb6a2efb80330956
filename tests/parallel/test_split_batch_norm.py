"""A training-mode ``nn.BatchNorm`` on rows split across ranks trains as on one device.

In semi_auto the plan keeps a training batch norm's rows split (``NodePlan.local ==
"split_batch_norm"``): each rank gathers only the per-channel statistics of the others' rows (one
AllGather forward, its adjoint a ReduceScatter backward) and normalizes its own rows with the
whole batch's. The loss, every gradient and the running statistics equal one device's; the
evaluation-mode forward afterwards too.

A batch norm with ``momentum=None`` (a cumulative moving average, whose factor torch reads from
``num_batches_tracked`` with ``float()``) was refused at capture with a ``CaptureError`` (fake
buffers have no value); it now trains as on one device in both automatic modes, with each rank
passing its rows or the whole batch, and when the step runs the network twice.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

from ..zoo import recording_step, semi_auto_matches

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(4, momentum=0.3)
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.bn1d = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn2d(self.conv(x) * 3 + 1))  # (a mean and scale far from 0 and 1)
        return F.cross_entropy(self.bn1d(self.fc(h.flatten(1))), y)


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return net(x, y)  # type: ignore[no-any-return]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g))] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_batch_norm_trains_like_one_device(world_size: int) -> None:
    data = batches()  # (made outside the world: plain tensors)
    ref = Net()
    grads: list[dict[str, torch.Tensor]] = []
    step = recording_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss_of, grads)
    losses = [step(x, y).detach() for x, y in data]
    net = Net()
    with simulated_world(world_size) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        parallel, rec = semi_auto_matches(world, net, opt, loss_of, data, losses, grads)
        for name in ("bn2d", "bn1d"):
            for stat in ("running_mean", "running_var", "num_batches_tracked"):
                got, want = getattr(net, name), getattr(ref, name)
                assert_matches_single_device(
                    getattr(got, stat), getattr(want, stat), what=f"{name}.{stat}"
                )
        plan = parallel.parallel_plan
        assert plan is not None
        split = [n.name for n in plan.nodes if n.local == "split_batch_norm"]
        assert split == ["bn2d/batch_norm", "bn1d/batch_norm"], split
    ranks = tuple(range(world_size))
    want = Counter(
        {
            ("AllGather", "forward", ranks): 2 * 2,  # (two norms, two steps)
            ("ReduceScatter", "backward", ranks): 2 * 2,
            ("AllReduce", "forward", ranks): 2,  # the loss
            ("AllReduce", "backward", ranks): 2,  # the gradient bucket
        }
    )
    assert rec.kinds() == want, rec.summary()


def cumulative_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3))


def cumulative_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, twice: bool) -> torch.Tensor:
    loss = F.cross_entropy(net(x * 3 + 1), y)
    return loss + F.cross_entropy(net(x), y) if twice else loss


@pytest.mark.parametrize(
    ("mode", "strategy", "twice"),
    [
        ("semi_auto", "data_parallel", False),
        ("semi_auto", "full_batch", False),
        ("sharding_propagation", "data_parallel", False),
        ("sharding_propagation", "full_batch", False),
        ("semi_auto", "data_parallel", True),
    ],
)
def test_cumulative_moving_average_trains_like_one_device(
    mode: str, strategy: str, twice: bool
) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))] * 3
    ref = cumulative_net()
    grads: list[dict[str, torch.Tensor]] = []
    step = recording_step(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1),
        lambda n, x, y: cumulative_loss(n, x, y, twice), grads,
    )  # fmt: skip
    losses = [step(x, y).detach() for x, y in data]
    net = cumulative_net()
    with simulated_world(2) as world:
        world.replicate(net)
        seen: list[dict[str, torch.Tensor]] = []
        train = recording_step(
            net, torch.optim.SGD(net.parameters(), lr=0.1),
            lambda n, x, y: cumulative_loss(n, x, y, twice), seen,
        )  # fmt: skip
        parallel = sw.AutoParallel(train, parallel_mode=mode).dataset_strategy(strategy)
        give = world.rows if strategy == "data_parallel" else world.same
        for s, (x, y) in enumerate(data):
            assert_matches_single_device(parallel(give(x), give(y)), losses[s], what=f"loss {s}")
            assert_matches_single_device(seen[s], grads[s], what=f"grads {s}")
        for stat in ("running_mean", "running_var", "num_batches_tracked"):
            assert_matches_single_device(
                getattr(net[1], stat), getattr(ref[1], stat), what=f"bn.{stat}"
            )
        assert net[1].momentum is None
