"""Delayed init under `AutoParallel` on real gloo processes, run by train_step_worker.py in the
same job (test_train_step_real.py).

Each process builds seed 003's initializer network (Layout version) and its SGD optimizer inside
``sw.no_init_parameters()``; AutoParallel's first call materializes this rank's blocks in place
(the optimizer's Parameter objects are the module's). Every process also runs the eager
single-device network itself (same seed) and checks its blocks before the first step, the 3
losses and its blocks and gradients after each backward (1e-5 relative). Prints
``CHECK delayed init ...``; a mismatch raises.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from test_delayed_init_parity import BATCH, LR, SEED, Network, data, single_device

import shardwise as sw
from shardwise.communication import get_group_size, get_rank
from shardwise.parallel import AutoParallel
from shardwise.planner import ParallelPlan


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"rank {get_rank()}: delayed init {what} differs (max diff {diff})")


def check(
    net: torch.nn.Module,
    plan: ParallelPlan,
    state: Mapping[str, torch.Tensor],
    rank: int,
    grads: bool,
) -> None:
    for name, p in net.named_parameters():
        index = plan.params[name].layout.local_slice(rank, tuple(state[name].shape))
        close(p.detach(), state[name][index], name)
        if grads:
            assert p.grad is not None, name
            close(p.grad, state[name + ".grad"][index], name + ".grad")


def delayed_init() -> None:
    """The check, in a job already initialized (`sw.communication.init()`)."""
    rank, n = get_rank(), get_group_size()
    initial, losses, states = single_device(layouts=True)
    torch.manual_seed(SEED)
    with sw.no_init_parameters():
        net = Network(layouts=True)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
    assert all(sw.parameter.is_deferred(p) for p in net.parameters())
    rows = BATCH // n
    batches = data()
    parallel = AutoParallel(net)
    plan = parallel.plan(batches[0][0][rank * rows : (rank + 1) * rows])
    held = opt.param_groups[0]["params"]
    assert all(a is b for a, b in zip(held, net.parameters(), strict=True)), "optimizer objects"
    check(net, plan, initial, rank, grads=False)
    print("CHECK delayed init step 0 init OK", flush=True)
    for step, (x, y) in enumerate(batches):
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = sw.ops.AllReduce()(F.cross_entropy(parallel(x[mine]), y[mine])) / n
        loss.backward()
        close(loss.detach(), torch.tensor(losses[step]), f"loss {step}")
        check(net, plan, states[step], rank, grads=True)
        opt.step()
        opt.zero_grad()
        print(f"CHECK delayed init step {step} OK", flush=True)
