"""An optimizer stepping with a closure (``opt.step(closure)``, the closure calling the wrapped
network and ``loss.backward()``) under optimizer parallel, the module form
(``AutoParallel(net).hsdp(...)``).

Level 1 reduces the gradients it holds when the optimizer's step starts (a step pre hook); a
closure's backward runs inside the step, after that hook, so SGD and Adam updated the shards
without the closure's gradients (weights 1e-2 off one device after one step, also when only
later steps had a closure). Now the gradients a closure made are reduced when it returns,
before the update, with the collectives a step without a closure runs. Levels 2 and 3 reduce
in backward and were right already. 2 simulated ranks; the weights equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import CommRecorder, assert_matches_single_device, simulated_world

g = torch.Generator().manual_seed(0)
DATA = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def one_device(optimizer: str) -> nn.Module:
    net = build()
    opt = OPTIMIZERS[optimizer](net.parameters())
    for x, y in DATA:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return net


def trained(optimizer: str, level: str, closures: tuple[bool, ...]) -> None:
    """`DATA`'s steps on 2 ranks, step s with a closure where `closures[s]`, each parameter
    after equal to one device's (each rank: its half of dim 0); every ReduceScatter of a
    step with a closure runs when the optimizer steps (level 1) as without one."""
    ref = one_device(optimizer)
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = OPTIMIZERS[optimizer](net.parameters())
        parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
        parallel.hsdp(threshold=0, optimizer_level=level)
        counts = []
        for (x, y), closed in zip(DATA, closures, strict=True):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = F.cross_entropy(parallel(world.rows(x)), world.rows(y))
                loss.backward()
                return loss

            with CommRecorder() as rec:
                if closed:
                    opt.step(closure)
                else:
                    closure()
                    opt.step()
            counts.append((rec.count("ReduceScatter"), rec.count("ReduceScatter", "step")))
        for name, p in ref.named_parameters():
            want = p.detach().chunk(2)
            assert_matches_single_device(
                net.get_parameter(name).detach(), lambda r, w=want: w[r], what=name
            )
    assert len(set(counts[1:])) == 1, counts  # (the same collectives with and without)
    assert counts[-1][0] > 0 and counts[-1][1] == (counts[-1][0] if level == "level1" else 0)


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_closure_step_updates_as_one_device(optimizer: str, level: str) -> None:
    """Every step with a closure (the first makes the wrapper's first call inside it)."""
    trained(optimizer, level, (True, True, True))


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_closures_after_a_step_without_one_update_as_one_device(level: str) -> None:
    """A first step without a closure, then two with one (and the reverse order)."""
    trained("sgd", level, (False, True, True))
    trained("adam", level, (True, False, True))
