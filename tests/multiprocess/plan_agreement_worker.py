"""Ranks that plan a call differently, on 2 real gloo processes (test_plan_agreement_real.py):
annotations that depend on the rank stop every rank with a ValueError at the first call,
through the job's store, instead of a wait until SHARDWISE_COMM_TIMEOUT or a gloo error; the
job goes on afterwards. Prints ``CHECK <name> OK`` lines. Last, `uneven_last_batch`: rank 1
alone plans again (a partial last batch) and fails the job with a ValueError."""

from __future__ import annotations

import time

import torch
from torch import nn

import shardwise as sw


class Net(nn.Module):
    def __init__(self, strategy: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self.w = sw.Parameter(sw.initializer("normal", [32, 16], torch.float32))
        self.mm = sw.ops.MatMul().shard(strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x, self.w)


def call(strategy: tuple[tuple[int, ...], ...], rank: int) -> float:
    """One train step of `Net` under semi_auto, this rank's rows of a fixed batch."""
    sw.set_seed(1)
    net = Net(strategy)
    opt = torch.optim.SGD(net.parameters(), 0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    wrapper = sw.AutoParallel(step, parallel_mode="semi_auto")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    try:
        return float(wrapper(x[rank * 4 : (rank + 1) * 4]))
    finally:
        wrapper.remove()


def refused(strategy: tuple[tuple[int, ...], ...], rank: int) -> str:
    try:
        call(strategy, rank)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: strategy {strategy} was not refused")


def checks() -> None:
    rank = sw.communication.get_rank()
    # each rank's strategy is valid, but they differ: both ranks name the op and both versions
    said = refused(((2, 1), (1, 1)) if rank == 0 else ((1, 2), (2, 1)), rank)
    assert "rank 1 planned this call unlike rank 0" in said, said
    assert "mm/MatMul" in said and "(g0, None), (None, None)" in said, said
    assert "(None, g0), (g0, None)" in said and "same annotations" in said, said
    print("CHECK divergent-strategies OK", flush=True)
    # rank 1's strategy is invalid: rank 1 raises its own error, rank 0 names rank 1 and it
    said = refused(((2, 1), (1, 1)) if rank == 0 else ((3, 1), (1, 1)), rank)
    assert "does not divide the device count 2" in said, said
    if rank == 0:
        assert "rank 1 could not plan this call (ValueError: mm (MatMul)" in said, said
    print("CHECK one-rank-invalid-strategy OK", flush=True)
    # the same annotations on every rank still run (the ranks' store keys stay in step)
    assert torch.isfinite(torch.tensor(call(((2, 1), (1, 1)), rank)))
    print("CHECK same-strategies-after OK", flush=True)
    uneven_last_batch(rank)


def uneven_last_batch(rank: int) -> None:
    """After a step of 4 rows on each rank, rank 0 passes 4 rows again (it runs its plan and
    waits in its first collective) and rank 1 passes 3 (it plans again): rank 1 raises a
    ValueError naming its shapes, rank 0 and the fix once rank 0's announcement does not come
    (SHARDWISE_COMM_TIMEOUT / 2), before rank 0's collective times out; the job fails with it.
    Rank 1 prints how long the call took (``UNEVEN <seconds>``)."""
    sw.set_seed(1)
    wrapper = sw.AutoParallel(Net(((1, 2), (2, 1))), parallel_mode="semi_auto")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    wrapper(x[rank * 4 : (rank + 1) * 4]).square().mean().backward()
    rows = 4 if rank == 0 else 3
    began = time.monotonic()
    try:
        wrapper(x[rank * 4 : rank * 4 + rows])
    finally:
        print(f"UNEVEN {time.monotonic() - began:.1f}", flush=True)
    raise AssertionError(f"rank {rank}: {rows} rows against 4 on rank 0 were not refused")


if __name__ == "__main__":
    sw.communication.init()
    checks()
    sw.communication.release()
