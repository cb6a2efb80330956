"""Worker for test_no_grad_forward_first_real.py: a Megatron 1 x 2 train step that runs the
network under ``torch.no_grad()`` or ``torch.inference_mode()`` (a self-distillation target)
before its training forward, on real gloo processes (a simulated world's tensors cannot take
views under inference mode). Every rank passes the whole batch; the three steps' losses and
the row-parallel layer's bias equal one device's. Prints ``CHECK no_grad_first_<mode> OK``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication import init

MODES: dict[str, type[AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def train(mode: str, wrapped: bool) -> tuple[list[float], torch.Tensor]:
    """Three steps' losses and the row-parallel bias after them (one device or wrapped)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if wrapped:
        sw.shard(net[0], in_strategy=((1, 1), (2, 1)))
        sw.shard(net[2], in_strategy=((1, 2), (1, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with MODES[mode]():
            t = net(a).softmax(-1).clone()
        out = net(a)
        loss = F.cross_entropy(out, b) + (out.log_softmax(-1) * -t).sum(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = sw.AutoParallel(step, parallel_mode="semi_auto") if wrapped else step
    if wrapped:
        run.dataset_strategy("full_batch")
    losses = [float(torch.as_tensor(run(x, y)).detach()) for _ in range(3)]
    return losses, net[2].bias.detach().clone()


def main() -> None:
    init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    for mode in MODES:
        want, bias = train(mode, wrapped=False)
        got, got_bias = train(mode, wrapped=True)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_bias, bias, rtol=1e-5, atol=1e-6)
        print(f"CHECK no_grad_first_{mode} OK", flush=True)


if __name__ == "__main__":
    main()
