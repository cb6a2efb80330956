"""Worker for test_data_parallel_real.py: `DataParallelRunner` with optimizer parallel on real
gloo processes. Seed 000's MLP, fusion ids 0/1/2 per layer, Adam, the default 64 KiB threshold
(on 4 ranks: ``1.weight`` owned by rank 0, ``3.weight`` by rank 1, ranks 2 and 3 own nothing);
every rank passes its rows of the same 5 global batches of 32.

Writes ``<out>/rank_<r>.json`` (losses, owners, the names of the parameters that have optimizer
state on this rank, their state bytes, the collectives per step, which gradients the update of
the last step did not see and which were None after it) and ``<out>/rank_<r>.pt`` (the final
parameters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_rank, init
from shardwise.optim import DataParallelRunner
from shardwise.testing import CommRecorder

STEPS, BATCH = 5, 32


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )
    for layer, fusion_id in zip((net[1], net[3], net[5]), (0, 1, 2), strict=True):
        sw.set_comm_fusion(layer, fusion_id)
    return net


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=1e-4, eps=1e-6)


def main() -> None:
    out = Path(sys.argv[1])
    init()
    rank = get_rank()
    net, loss_fn = make_net(), nn.CrossEntropyLoss()
    optimizer = make_optimizer(net)
    hidden: list[str] = []  # (seen by a pre-hook registered after the runner's: in the update)
    after: list[str] = []
    names = {id(p): n for n, p in net.named_parameters()}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        after[:] = [n for n, p in net.named_parameters() if p.grad is None]
        optimizer.zero_grad()
        return loss

    runner = DataParallelRunner(net, [optimizer], train_step=train_step, parallel_optimizer=True)

    def in_update(*_: object) -> None:
        hidden[:] = [n for n, p in net.named_parameters() if p.grad is None]

    optimizer.register_step_pre_hook(in_update)
    losses = []
    with CommRecorder() as rec:
        n = sw.communication.get_group_size()
        for x, y in make_data():
            mine = slice(rank * BATCH // n, (rank + 1) * BATCH // n)  # this rank's rows
            losses.append(float(runner(x[mine], y[mine])))
    state = {names[id(p)]: s for p, s in optimizer.state.items()}
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in state.values()
        for k, t in s.items()
        if k != "step" and isinstance(t, torch.Tensor)
    )
    report = {
        "losses": losses,
        "owners": runner.owners,
        "state_params": sorted(state),
        "state_bytes": state_bytes,
        "hidden_grads": hidden,
        "no_grad_after_step": after,
        "collectives": {k: rec.count(k) // STEPS for k in ("AllReduce", "Broadcast")},
        "plan": str(runner),
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(report))
    torch.save({n: p.detach() for n, p in net.named_parameters()}, out / f"rank_{rank}.pt")
    sw.communication.release()


if __name__ == "__main__":
    main()
