"""An optimizer stepping with a closure (``opt.step(closure)``, the closure calling the network
and ``loss.backward()``) in ``parallel_mode="data_parallel"``, with and without hsdp's owner
update, module form and train-step form.

The runner averages the gradients when the optimizer's step starts (a step pre hook); a
closure's backward runs inside the step, after that hook, so SGD and Adam updated every rank
with its own rows' gradients (weights 1e-2 off one device after one step). Now a step with a
closure averages when the closure returns, before the update. 2 simulated ranks; the weights
(every rank's) equal one device's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

from .test_hsdp_closures import DATA, OPTIMIZERS, build, one_device


@pytest.mark.parametrize("hsdp", [False, True], ids=["plain", "hsdp"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("form", ["module", "step"])
def test_a_closure_step_matches_one_device(form: str, optimizer: str, hsdp: bool) -> None:
    ref = one_device(optimizer)
    net = build()
    with simulated_world(2) as world:
        world.replicate(net)
        opt = OPTIMIZERS[optimizer](net.parameters())

        def closure_for(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = run()
                loss.backward()
                return loss

            return closure

        if form == "module":
            parallel = sw.AutoParallel(net, parallel_mode="data_parallel", optimizer=opt)
            if hsdp:
                parallel.hsdp(threshold=0)
            for i, (x, y) in enumerate(DATA):
                xr, yr = world.rows(x), world.rows(y)
                if i == 0:  # (a first step without a closure, then with)
                    opt.zero_grad()
                    F.cross_entropy(parallel(xr), yr).backward()
                    opt.step()
                else:
                    opt.step(closure_for(lambda xr=xr, yr=yr: F.cross_entropy(parallel(xr), yr)))
        else:

            def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                loss = opt.step(closure_for(lambda: F.cross_entropy(net(a), b)))
                assert loss is not None
                return loss.detach()

            parallel = sw.AutoParallel(step, parallel_mode="data_parallel")
            if hsdp:
                parallel.hsdp(threshold=0)
            for x, y in DATA:
                parallel(world.rows(x), world.rows(y))
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            assert_matches_single_device(p.detach(), q.detach(), what=name)
