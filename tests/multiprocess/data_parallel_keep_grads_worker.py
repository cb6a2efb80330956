"""Worker for test_data_parallel_real.py's kept-gradients test: parallel_mode="data_parallel"
with ``hsdp(threshold=0)`` (every parameter updated by its owner rank only, then broadcast) on
real gloo processes, trained two steps without ``zero_grad`` (legal torch: one device's second
step uses the sum of both steps' gradients). After each ``opt.step()`` every rank's ``.grad``
of every parameter, its owner's or not, is one device's (the ranks' average, accumulated), and
the parameters after each step are one device's. Module form and train-step form. Prints
``CHECK <case> OK`` per case."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

STEPS, ROWS = 2, 8
CASES = ("dp-hsdp-keep-grads-module", "dp-hsdp-keep-grads-step")

Snapshot = tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (every rank takes its rows of each)."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)) for _ in range(STEPS)
    ]


def snapshot(net: nn.Module) -> Snapshot:
    """Each parameter's ``.grad`` (None kept) and value."""
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}
    return grads, {k: p.detach().clone() for k, p in net.named_parameters()}


def one_device() -> list[Snapshot]:
    """One device's gradients and parameters after each step, gradients never zeroed."""
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = []
    for x, y in data():
        F.mse_loss(net(x), y).backward()
        opt.step()
        out.append(snapshot(net))
    return out


def wrapped(form: str) -> list[Snapshot]:
    """The same training on this rank's rows, in data_parallel mode with owner updates."""
    n, rank = get_group_size(), get_rank()
    rows = slice(rank * ROWS // n, (rank + 1) * ROWS // n)
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out: list[Snapshot] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()  # (no zero_grad: the next step adds to these gradients)
        out.append(snapshot(net))
        return loss

    target: Callable[..., torch.Tensor] | nn.Module = net if form == "module" else step
    wrapper = sw.AutoParallel(target, parallel_mode="data_parallel", optimizer=opt)
    wrapper.hsdp(threshold=0)
    for x, y in data():
        if form == "module":
            F.mse_loss(wrapper(x[rows]), y[rows]).backward()
            opt.step()
            out.append(snapshot(net))
        else:
            wrapper(x[rows], y[rows])
    wrapper.remove()
    return out


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    want = one_device()
    for name in CASES:
        got = wrapped(name.rsplit("-", 1)[1])
        assert len(got) == STEPS, (name, len(got))
        for s, ((grads, params), (want_grads, want_params)) in enumerate(
            zip(got, want, strict=True)
        ):
            for k, grad in grads.items():
                assert grad is not None, (name, s, k, "no .grad after the step")
                torch.testing.assert_close(
                    grad, want_grads[k], rtol=1e-5, atol=1e-5, msg=f"{name} step {s} grad {k}"
                )
                torch.testing.assert_close(
                    params[k], want_params[k], rtol=1e-5, atol=1e-5, msg=f"{name} step {s} {k}"
                )
        print(f"CHECK {name} OK", flush=True)


def main() -> None:
    init()
    checks()
    sw.communication.release()


if __name__ == "__main__":
    main()
