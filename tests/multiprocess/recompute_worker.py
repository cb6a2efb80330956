"""Worker for test_recompute_real.py: activation-checkpointed blocks with dropout on real gloo
processes, where the dropout masks come from each process's own generators (a simulated world
keeps per-rank states instead). Each rank passes its rows (data parallel) or the whole batch
(1 x 2 Megatron: every rank the same rows); the three steps' losses equal one device's. Prints
``CHECK <case> OK`` per case."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.relu(self.fc1(x)), 0.3, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.hidden(x))


class Net(nn.Module):
    """Two blocks; `region`: "" (none), "block" (each whole block checkpointed), "hidden" (only
    fc1 and its dropout: under Megatron the region's output is a model-parallel split) or
    "reentrant" (each whole block, ``use_reentrant=True``)."""

    def __init__(self, region: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)  # (a reentrant region's input must require grad)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            if self.region == "block":
                x = checkpoint(b, x, use_reentrant=False)
            elif self.region == "reentrant":
                x = checkpoint(b, x, use_reentrant=True)
            elif self.region == "hidden":
                x = x + b.fc2(checkpoint(b.hidden, x, use_reentrant=False))
            else:
                x = b(x)
        out: torch.Tensor = self.head(x)
        return out


CASES = [("data_parallel", "block"), ("megatron", "block"), ("megatron", "hidden")]
CASES += [("data_parallel", "reentrant"), ("megatron", "reentrant")]


def losses(mode: str, region: str, rows: Callable[[torch.Tensor], torch.Tensor]) -> list[float]:
    """Three steps' losses: one device (`rows` None) or wrapped."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    net = Net(region)
    if region and mode == "megatron":
        for b in net.blocks:
            sw.shard(b.fc1, in_strategy=((1, 1), (2, 1)))
            sw.shard(b.fc2, in_strategy=((1, 2), (1, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def train(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(net(a), b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if region:
        step = sw.AutoParallel(train)
        args = (rows(x), rows(y)) if mode == "data_parallel" else (x, y)
        if mode == "megatron":
            step.dataset_strategy("full_batch")
    else:
        step, args = train, (x, y)
    torch.manual_seed(5)
    return [float(torch.as_tensor(step(*args)).detach()) for _ in range(3)]


def main() -> None:
    init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    n, rank = get_group_size(), get_rank()

    def rows(t: torch.Tensor) -> torch.Tensor:
        k = t.shape[0] // n
        return t[rank * k : (rank + 1) * k]

    for mode, region in CASES:
        want = losses(mode, "", rows)
        got = losses(mode, region, rows)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        print(f"CHECK {mode}_{region} OK", flush=True)


if __name__ == "__main__":
    main()
