"""Worker for test_loss_overlap_real.py: wrapped train steps that read the loss at every point
the plan executor must finish the loss's started AllReduce, on real gloo processes (in a
simulated world it runs at once). Each rank passes its rows of one global batch, whose first
rows are padding (``ignore_index``): the ranks count different targets, so the mean loss is
weighed by the counts, and a backward that does not wait for the summed count is corrected in
the gradient buckets. Every loss the step reads or returns and the parameters after it equal
one device's. Prints ``CHECK <case> OK`` per case."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

Step = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor, list[float]], object]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    y[:4] = -100  # (padding: of 2 ranks the first counts no target, the second 4)
    return x, y


def read_before_backward(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    loss = F.cross_entropy(net(x), y)
    copy = loss.detach().clone()  # (an op on the loss at once: the AllReduce finished first)
    loss.backward()
    seen.append(float(copy))
    opt.step()
    return loss


def returned(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    loss = F.cross_entropy(net(x), y)
    loss.backward()  # (the AllReduce runs alongside, finished after it)
    opt.step()
    opt.zero_grad()
    return loss


def accumulated(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    for _ in range(2):  # the plan runs twice: each loss finished before the next forward
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        seen.append(float(loss.detach()))
    opt.step()
    return loss


def scaled(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    loss = F.cross_entropy(net(x), y)
    (loss * 2).backward()  # (an op on the loss: finished before it)
    opt.step()
    return loss


def closure(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    def loss_of() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    return opt.step(loss_of)


def after_step(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()  # (finished before the step, whose ops the executor does not see)
    seen.append(float(loss.detach()))
    return F.cross_entropy(net(x), y)  # the network again: the updated net's loss


def regularized(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    loss = F.cross_entropy(net(x), y)
    l2 = sum((p * p).sum() for p in net.parameters())
    (loss + 0.01 * l2).backward()  # (gradients not only through the loss: alike on every rank)
    opt.step()
    opt.zero_grad()
    return loss


def pad_class(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    # (class 0 weighs 0, the padding its rows: rank 0's mean is 0 / 0, its backward divided by 0)
    loss = F.cross_entropy(net(x), y.clamp(min=0), weight=torch.tensor([0.0, 1.0, 1.0]))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def inference(net, opt, x, y, seen):  # type: ignore[no-untyped-def]
    with torch.inference_mode():  # (an inference tensor: finished in place all the same)
        loss = F.cross_entropy(net(x), y)
    return loss


CASES: list[Step] = [
    read_before_backward,
    returned,
    accumulated,
    scaled,
    closure,
    after_step,
    regularized,
    pad_class,
    inference,
]


def run(step: Step, parallel: bool, rows: Callable[[torch.Tensor], torch.Tensor]) -> list[float]:
    """The losses `step` reads and returns (two calls), then its parameters, flattened."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen: list[float] = []
    x, y = batch()

    def train(a: torch.Tensor, b: torch.Tensor) -> object:
        return step(net, opt, a, b, seen)

    call = sw.AutoParallel(train, parallel_mode="semi_auto") if parallel else train
    args = (rows(x), rows(y)) if parallel else (x, y)
    out = [float(torch.as_tensor(call(*args)).detach()) for _ in range(2)]  # type: ignore[arg-type]
    return seen + out + torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()


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

    for step in CASES:
        want = run(step, False, rows)
        got = run(step, True, rows)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        print(f"CHECK {step.__name__} OK", flush=True)


if __name__ == "__main__":
    main()
