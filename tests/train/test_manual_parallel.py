"""Manual data parallel (seed 004) on 2, 4, 8 simulated ranks equals single-device training:
each rank slices its rows of the global batch, the loss is all-reduced and averaged, and
DistributedGradReducer averages the gradients. Per-step losses and final parameters match."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.nn
import shardwise.train
from shardwise.communication import get_group_size, get_rank
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

GLOBAL_BATCH = 32
STEPS = 3


class Network(nn.Module):
    """Seed 004's network: the rank's rows of the batch, then Flatten + Dense 784-512-512-10."""

    def __init__(self, sliced: bool) -> None:
        super().__init__()
        self.sliced = sliced
        self.flatten = nn.Flatten()
        self.layer1 = nn.Linear(28 * 28, 512)
        self.layer2 = nn.Linear(512, 512)
        self.layer3 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sliced:
            shard = x.shape[0] // get_group_size()
            rank = get_rank()
            x = x[rank * shard : rank * shard + shard]
        x = torch.relu(self.layer1(self.flatten(x)))
        return self.layer3(torch.relu(self.layer2(x)))


class ReduceLoss(nn.Module):
    """Seed 004's loss: slice the labels, cross entropy, AllReduce, divide by the rank count."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.all_reduce = sw.ops.AllReduce()

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        n = get_group_size()
        shard = label.shape[0] // n
        rank = get_rank()
        label = label[rank * shard : rank * shard + shard]
        return self.all_reduce(self.loss(logits, label)) / n


class Record(sw.train.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.losses.append(ctx.net_outputs)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=g),
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def single_device(net: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), 1e-2)
    rec = Record()
    sw.train.Model(net, nn.CrossEntropyLoss(), opt).train(1, batches(), callbacks=[rec])
    return rec.losses, {k: v.detach() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_manual_data_parallel_matches_single_device(n: int) -> None:
    sw.set_seed(1)
    template = Network(sliced=False)
    want_losses, want_params = single_device(template)
    plain = batches()  # made outside the world: inside, each rank would draw its own numbers
    with simulated_world(n) as world, CommRecorder() as rec:
        net = copy.deepcopy(template)
        net.sliced = True
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), 1e-2)
        reducer = sw.nn.DistributedGradReducer(net.parameters())
        record = Record()
        model = sw.train.Model(net, ReduceLoss(), opt, grad_reducer=reducer)
        data = [(world.same(x), world.same(y)) for x, y in plain]
        model.train(1, data, callbacks=[record])
        assert_matches_single_device(record.losses, want_losses, what="losses")
        assert_matches_single_device(dict(net.state_dict()), want_params, what="params")
    # per step: the loss AllReduce (forward and backward) and one fused gradient bucket
    assert rec.count("AllReduce", "forward") == 2 * STEPS
    assert rec.count("AllReduce", "backward") == STEPS
    assert rec.count() == 3 * STEPS


def test_without_reducer_parameters_diverge() -> None:
    """Seed 004 as printed (loss AllReduce only) lets each rank follow its own gradient."""
    sw.set_seed(1)
    template = Network(sliced=True)
    plain = batches()
    with simulated_world(2) as world:
        net = world.replicate(copy.deepcopy(template))
        model = sw.train.Model(net, ReduceLoss(), torch.optim.SGD(net.parameters(), 1e-2))
        model.train(1, [(world.same(x), world.same(y)) for x, y in plain])
        w = net.layer1.weight
        assert not torch.equal(world.local(w, 0), world.local(w, 1))


def test_replicate_accepts_shardwise_parameters() -> None:
    """sw.Parameter (a Parameter subclass LocalTensorMode rejects) replicates by value."""
    net = nn.Linear(2, 2)
    net.weight = sw.Parameter(torch.ones(2, 2), name="w")
    with simulated_world(2) as world:
        world.replicate(net)
        assert_matches_single_device(net.weight, torch.ones(2, 2))
