"""`AutoParallel` wrapping a train-step function (API.md's pattern), 8 simulated ranks.

Seed 003's network (its int strategies and its Layout version) with ``nn.CrossEntropyLoss``
and SGD built before the wrapper; the train step is the seed's, unchanged. With the default
``"data_parallel"`` dataset strategy each rank passes its rows of the global batch, with
``"full_batch"`` the whole batch. For 3 steps the returned loss (the same on every rank) and
every parameter block after each update equal the single-device run. Also: how the wrapper
finds the network and optimizers (closure cells, globals, ``network=`` / ``optimizer=``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.parallel import AutoParallel
from shardwise.testing import assert_matches_single_device, simulated_world

sys.path.insert(0, str(Path(__file__).parent))
from test_seed003_parity import LR, WORLD, Network, data


def single_device(layouts: bool) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and the parameters after each step's update."""
    net, loss_fn = Network(layouts), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    losses, params = [], []
    for x, y in data():
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


@pytest.mark.parametrize(
    ("layouts", "strategy"),
    [(False, "data_parallel"), (True, "data_parallel"), (False, "full_batch")],
    ids=["int", "layout", "int-full_batch"],
)
def test_seed003_train_step_matches_single_device(layouts: bool, strategy: str) -> None:
    losses, params = single_device(layouts)
    batches, net = data(), Network(layouts)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR)  # before AutoParallel
        loss_fn = torch.nn.CrossEntropyLoss()

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = loss_fn(net(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        parallel_net = AutoParallel(train_step, parallel_mode="semi_auto")
        assert parallel_net.network is net and parallel_net.optimizers == [optimizer]
        parallel_net.dataset_strategy(strategy)
        for step, (image, label) in enumerate(batches):
            give = world.same if strategy == "full_batch" else world.rows
            loss = parallel_net(give(image), give(label))
            assert_matches_single_device(loss, torch.tensor(losses[step]), what=f"loss {step}")
            plan = parallel_net.parallel_plan
            assert plan is not None
            for name, p in net.named_parameters():
                layout, shape = plan.param_layouts()[name]
                full = params[step][name]
                assert_matches_single_device(
                    p.detach(), lambda r, f=full, s=shape, lay=layout: f[lay.local_slice(r, s)]
                )


GLOBAL_NET = nn.Linear(2, 2)
GLOBAL_OPT = torch.optim.SGD(GLOBAL_NET.parameters(), lr=0.1)


def _global_step(x: torch.Tensor) -> Any:
    loss = GLOBAL_NET(x).sum()
    loss.backward()
    GLOBAL_OPT.step()
    return loss


def test_finds_network_and_optimizers() -> None:
    other = nn.Linear(2, 2)
    parallel = AutoParallel(_global_step)  # globals named by the code
    assert parallel.network is GLOBAL_NET and parallel.optimizers == [GLOBAL_OPT]
    parallel = AutoParallel(_global_step, network=other, optimizer=[])
    assert parallel.network is other and parallel.optimizers == []
    net, loss_fn = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.MSELoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:  # closure cells; loss_fn has no params
        return loss_fn(net(x), y)

    assert AutoParallel(step).network is net
    with pytest.raises(ValueError, match="pass network="):
        AutoParallel(lambda x: net(x) + other(x))
    with pytest.raises(ValueError, match="dataset_strategy"):
        AutoParallel(step).dataset_strategy("model_parallel")


def test_optimizer_state_made_at_construction_is_cut() -> None:
    """Adagrad fills its state at construction, before the wrapper cuts the parameters: the
    state is cut to each rank's block the same way. (A non-zero initial accumulator keeps the
    first update from being ``lr * sign(grad)``, which turns rounding noise in near-zero
    gradients into differences of ``2 * lr``.)"""
    batches = data()
    single, loss_fn = Network(False), nn.CrossEntropyLoss()
    opt = torch.optim.Adagrad(single.parameters(), lr=0.05, initial_accumulator_value=0.1)
    want = []
    for x, y in batches:
        loss = loss_fn(single(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    net = Network(False)
    with simulated_world(WORLD) as world:
        world.replicate(net)
        optimizer = torch.optim.Adagrad(net.parameters(), lr=0.05, initial_accumulator_value=0.1)

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = loss_fn(net(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        parallel = AutoParallel(train_step)
        for step, (x, y) in enumerate(batches):
            loss = parallel(world.rows(x), world.rows(y))
            assert_matches_single_device(loss, torch.tensor(want[step]), what=f"loss {step}")
