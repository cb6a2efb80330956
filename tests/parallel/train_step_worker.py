"""Worker for test_train_step_real.py: API.md's train step on real gloo processes.

Seed 003's network with matmul3 -> nn.Linear and relu2 -> F.relu (test_unannotated_ops), the
loss ``nn.CrossEntropyLoss`` and SGD built before the wrapper; every process passes the global
batch. Each process computes the single-device run itself, then checks per step the returned
loss and its blocks of every parameter after the update (1e-5 relative). Prints
``CHECK step <k> OK``; a mismatch raises. Then seed 003's Layout version (seed003_worker.py),
delayed init (delayed_init_worker.py), and in the same processes the 8-rank checks of
``to_placements`` (tests/multiprocess/layout_placements_worker.py) and ``redistribute``
(redistribution_worker.py): one 8-process job for the tests that need 8 real ranks (each start
of 8 processes costs ~14 s on 2 cores; the ``eight_rank_job`` fixture).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "multiprocess"))

import torch
from delayed_init_worker import delayed_init
from layout_placements_worker import placements
from redistribution_worker import redistributions
from seed003_worker import seed003
from test_unannotated_ops import LR, Network, data

import shardwise as sw
from shardwise.communication import get_rank
from shardwise.parallel import AutoParallel


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"rank {get_rank()}: {what} differs (max abs diff {diff})")


def reference() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    net, loss_fn = Network(), torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, params = [], []
    for x, y in data():
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params


def main() -> None:
    sw.communication.init()
    rank = get_rank()
    losses, params = reference()
    net = Network()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(net(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    parallel_net = AutoParallel(train_step, parallel_mode="semi_auto")
    for step, (image, label) in enumerate(data()):
        loss = parallel_net(image, label)
        close(loss.detach(), losses[step], f"loss {step}")
        plan = parallel_net.parallel_plan
        assert plan is not None
        for name, p in net.named_parameters():
            want = params[step][name]
            if name in plan.params:
                layout, shape = plan.param_layouts()[name]
                want = want[layout.local_slice(rank, shape)]
            close(p.detach(), want, f"{name} step {step}")
        print(f"CHECK step {step} OK", flush=True)
    seed003()  # (seed 003's Layout version in the same processes: one 8-process job for all)
    delayed_init()  # (and delayed init under AutoParallel)
    placements()  # (to_placements on the real meshes)
    redistributions()  # (redistribute between tuple-axis and permuted layouts)
    sw.communication.release()


if __name__ == "__main__":
    main()
