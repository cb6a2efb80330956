"""Worker for test_gradients_real.py: gradients of backwards other than ``loss.backward()`` on
real gloo processes, each rank passing its rows: a backward from the output split over the
ranks (its seed scaled by the plan), a seed made from Python data, and the input gradient of a
wrapped network whose backward runs after the call. Prints ``CHECK <case> OK`` per case."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


CASES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "split_root": lambda out, y: out.backward(torch.cos(out.detach())),
    "python_seed": lambda out, y: ((out - y) ** 2).mean().backward(torch.tensor(0.5)),
}


def main() -> None:
    init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    n, rank = get_group_size(), get_rank()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    k = x.shape[0] // n
    mine = slice(rank * k, (rank + 1) * k)
    for name, run in CASES.items():
        ref = make()
        run(ref(x), y)
        net = make()

        def step(a: torch.Tensor, b: torch.Tensor, net: nn.Module = net, run=run) -> torch.Tensor:
            out = net(a)
            run(out, b)
            return out

        sw.AutoParallel(step)(x[mine], y[mine])
        got, want = grads(net), grads(ref)
        assert got.keys() == want.keys(), (name, got.keys())
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=1e-5, atol=1e-6)
        print(f"CHECK {name} OK", flush=True)
    ref, xr = make(), x.clone().requires_grad_()
    F.mse_loss(ref(xr), y).backward()
    net = make()
    xs = x[mine].clone().requires_grad_()
    F.mse_loss(sw.AutoParallel(net)(xs), y[mine]).backward()
    torch.testing.assert_close(xs.grad, xr.grad[mine], rtol=1e-5, atol=1e-6)
    print("CHECK module_input_grad OK", flush=True)


if __name__ == "__main__":
    main()
