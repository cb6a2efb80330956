"""Seed 003 (Layout version) under `AutoParallel` on real gloo processes, run by
train_step_worker.py in the same job (test_train_step_real.py).

Every process computes the single-device run itself (same seeds), then trains its blocks for 3
SGD steps and checks, per step, the loss and its blocks of every parameter and gradient
(1e-5 relative). Prints ``CHECK seed003 step <k> OK``; a mismatch raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_seed003_parity import BATCH, LR, Network, data, single_device

import shardwise as sw
from shardwise.communication import get_group_size, get_rank
from shardwise.parallel import AutoParallel


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"rank {get_rank()}: {what} differs (max abs diff {diff})")


def seed003() -> None:
    """The checks above, in a job `sw.communication.init()` started."""
    rank, n = get_rank(), get_group_size()
    losses, states = single_device(layouts=True)
    net = Network(layouts=True)
    parallel = AutoParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    rows = BATCH // n
    for step, (x, y) in enumerate(data()):
        mine = slice(rank * rows, (rank + 1) * rows)
        logits = parallel(x[mine])
        loss = sw.ops.AllReduce()(F.cross_entropy(logits, y[mine])) / n
        loss.backward()
        close(loss.detach(), torch.tensor(losses[step]), f"loss {step}")
        assert parallel.parallel_plan is not None
        for name, p in net.named_parameters():
            layout, shape = parallel.parallel_plan.param_layouts()[name]
            block = layout.local_slice(rank, shape)
            assert p.grad is not None
            close(p.detach(), states[step][name][block], f"{name} step {step}")
            close(p.grad, states[step][f"{name}.grad"][block], f"{name}.grad step {step}")
        opt.step()
        opt.zero_grad()
        print(f"CHECK seed003 step {step} OK", flush=True)
