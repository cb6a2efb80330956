"""A network with a lazy module (``nn.LazyLinear``, ``nn.LazyBatchNorm1d``) whose parameters are
not made yet is refused before planning, in every automatic mode and the train-step form, with
a ValueError naming the parameter, the module and the fix (torch's "Can't access the shape of
an uninitialized parameter" came from inside the capture or the data-parallel runner before).
Made by one forward before wrapping, as the message says, it trains as on one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import simulated_world

from ..zoo import recording_step, semi_auto_matches

pytestmark = pytest.mark.usefixtures("one_thread")


def lazy_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d(momentum=None), nn.Linear(8, 3))


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x), y)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g))] * 2


@pytest.mark.parametrize("mode", ["semi_auto", "data_parallel", "sharding_propagation"])
@pytest.mark.parametrize("form", ["module", "train_step"])
def test_a_lazy_module_not_made_yet_is_refused(mode: str, form: str) -> None:
    net = lazy_net()
    (x, y), _ = data()
    with simulated_world(2) as world:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        wrapped = (
            sw.AutoParallel(net, parallel_mode=mode)
            if form == "module"
            else sw.AutoParallel(recording_step(net, opt, loss_of, []), parallel_mode=mode)
        )
        args = (world.rows(x),) if form == "module" else (world.rows(x), world.rows(y))
        for _ in range(2):  # (refused again, not half planned)
            with pytest.raises(ValueError, match=r"'0.weight' of LazyLinear is not made yet.*"
                               r"net.eval\(\)\(x\); net.train\(\)"):  # fmt: skip
                wrapped(*args)


def test_made_by_one_forward_it_trains_like_one_device() -> None:
    batches = data()
    ref = lazy_net()
    ref.eval()(batches[0][0])
    ref.train()
    grads: list[dict[str, torch.Tensor]] = []
    step = recording_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), loss_of, grads)
    losses = [step(x, y).detach() for x, y in batches]
    net = lazy_net()
    net.eval()(batches[0][0])  # (the fix the message names)
    net.train()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        semi_auto_matches(world, net, opt, loss_of, batches, losses, grads)
