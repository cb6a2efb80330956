"""Worker for test_data_parallel_real.py's branch test: parallel_mode="data_parallel" with a
data-dependent branch that uses a head on rank 1's rows only, on real gloo processes, each rank
passing its rows. As in DDP, every rank gets the average of the ranks' gradients (rank 0's
share of the head's is zeros), a parameter no rank used keeps ``.grad`` None on every rank,
and the collectives agree (they aborted gloo: the ranks' flat buffers had other sizes). Cases:
the default buckets, one bucket per parameter (``comm_fusion`` off) and optimizer parallel
(``hsdp``, owners broadcast); then the same branch in manual data parallel
(``DistributedGradReducer``). Then complex64 parameters beside float32 and float64 ones
(tests/optim/test_data_parallel_complex.py's network), with and without ``hsdp``: three steps
whose losses, gradients and parameters equal one device's (their counts of ranks with a
gradient were complex, and reading them raised TypeError). Prints ``CHECK <case> OK`` per
case."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init
from shardwise.testing import CommRecorder, assert_matches_single_device

sys.path.insert(0, str(Path(__file__).parents[1] / "optim"))
import test_data_parallel_complex as complex_case


class Branchy(nn.Module):
    """A body, a head every rank uses, an extra head for rows with a large value (rank 1's
    only) and a head no rank reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.extra, self.never = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        loss = F.cross_entropy(self.head(h), y)
        if x.abs().max() > 5:  # (rank 1's rows only)
            loss = loss + self.extra(h).pow(2).mean()
        if x.abs().max() > 1e6:  # (no rank's)
            loss = loss + self.never(h).mean()
        return loss


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's rows: rank 1's scaled so that its rows take the extra head."""
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(4, 8, generator=g) * (3.0 if r == 1 else 1.0),
            torch.randint(0, 4, (4,), generator=g),
        )
        for r in range(n)
    ]


def one_device(n: int) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """DDP's reference: the mean of the ranks' losses on one device (each rank's rows through
    its own branch); the gradients and the parameters after one SGD step."""
    net = Branchy()
    opt = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)
    sum(net(x, y) for x, y in data(n)).div(n).backward()
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}
    opt.step()
    return grads, {k: p.detach().clone() for k, p in net.named_parameters()}


CASES: dict[str, Callable[[sw.AutoParallel], sw.AutoParallel]] = {
    "dp-branch-buckets": lambda w: w,
    "dp-branch-unfused": lambda w: w.comm_fusion({"openstate": False}),
    "dp-branch-hsdp": lambda w: w.hsdp(threshold=0),
}


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (two_ranks_worker.py
    runs them in the tests' one 2-process job)."""
    n, rank = get_group_size(), get_rank()
    want_grads, want_params = one_device(n)
    x, y = data(n)[rank]
    for name, configure in CASES.items():
        net = Branchy()
        opt = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)
        wrapper = configure(sw.AutoParallel(net, parallel_mode="data_parallel", optimizer=opt))
        wrapper(x, y).backward()
        opt.step()  # (its pre-hook averages the gradients)
        for k, p in net.named_parameters():
            want = want_grads[k]
            if want is None:  # (no rank used it)
                assert p.grad is None, (name, k, "a gradient")
                continue
            assert p.grad is not None, (name, k, "no gradient")  # (also one it does not own)
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5, msg=f"{name} {k}")
        for k, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), want_params[k], rtol=1e-5, atol=1e-5)
        assert not any(p in opt.state for p in net.never.parameters()), name  # (grad None)
        wrapper.remove()
        print(f"CHECK {name} OK", flush=True)
    _reducer_check(want_grads, x, y)
    _complex_checks(n, rank)


def _reducer_check(
    want_grads: dict[str, torch.Tensor | None], x: torch.Tensor, y: torch.Tensor
) -> None:
    """Manual data parallel with the same branch: ``DistributedGradReducer`` gives DDP's
    gradients (rank 0 has no gradient of the extra head, rank 1 has one; their buffers had
    other sizes: rank 1 got a wrong head gradient and rank 0's gloo aborted), in ONE AllReduce,
    and the head no rank used keeps ``.grad`` None."""
    net = Branchy()
    reducer = sw.nn.DistributedGradReducer(net.parameters())
    net(x, y).backward()
    with CommRecorder() as rec:
        reducer()
    assert rec.count("AllReduce") == 1, rec.count("AllReduce")
    for k, p in net.named_parameters():
        want = want_grads[k]
        if want is None:
            assert p.grad is None, (k, "a gradient")
        else:
            assert p.grad is not None, (k, "no gradient")
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5, msg=k)
    print("CHECK reducer-branch OK", flush=True)


def _complex_checks(n: int, rank: int) -> None:
    """Complex parameters in data_parallel mode, each rank passing its rows."""
    want, want_params = complex_case.one_device()
    k = complex_case.BATCHES[0].shape[0] // n
    for name, hsdp in (("dp-complex", False), ("dp-complex-hsdp", True)):
        net = complex_case.Net()
        wrapper = sw.AutoParallel(complex_case.stepper(net), parallel_mode="data_parallel")
        if hsdp:
            wrapper = wrapper.hsdp(threshold=0)
        for i, x in enumerate(complex_case.BATCHES):
            got = wrapper(x[rank * k : (rank + 1) * k])
            assert_matches_single_device(got["loss"], want[i]["loss"], what=f"{name} loss {i}")
            if not hsdp:  # (under hsdp only the owner's gradient is averaged)
                assert_matches_single_device(got["grads"], want[i]["grads"], what=f"{name} {i}")
        params = {pn: p.detach() for pn, p in net.named_parameters()}
        assert_matches_single_device(params, want_params, what=f"{name} params")
        wrapper.remove()
        print(f"CHECK {name} OK", flush=True)


def main() -> None:
    init()
    checks()
    sw.communication.release()


if __name__ == "__main__":
    main()
