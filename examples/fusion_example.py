"""Communication fusion ids (seed 001's ``fusion_example.py``) and the collectives they give.

Run: ``python examples/fusion_example.py --print-only`` (the tutorial's 12 lines), or on 8
workers ``shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output/fusion
--join True examples/fusion_example.py`` (``make demo-fusion``).

Part 1 is the tutorial: a `Net` of three `DenseLayer`s (two ``Linear(10, 10)`` each) whose
``__init__`` calls ``sw.set_comm_fusion`` with ids 0, 1 and 2; every trainable parameter's
fusion id is printed (``The parameter layer1.input_mapping.weight's fusion id is 0``).

Part 2 (not in the tutorial) trains the same network for 3 steps under
``sw.AutoParallel(train_step, parallel_mode="semi_auto").hsdp(threshold=0)`` and prints the
optimizer plan and the collectives of each step (`sw.CommRecorder`). Optimizer parallel splits a
parameter's dim 0 over the ranks, so a [10, 10] weight does not shard on 8 ranks; part 2 uses
``--hidden 16`` layers by default (every weight and bias divides by 8). Then id 0 gives one
AllGather and one ReduceScatter per parameter (4 each for layer1), ids 1 and 2 one fused
AllGather and one fused ReduceScatter per layer: 6 of each per step. The 1 AllReduce is the
loss's (the mean over the global batch in forward; ``loss.backward()`` in the train step needs
none: its seed is ones on every rank).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_rank, init


class DenseLayer(nn.Module):
    """A base layer with two dense layers."""

    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        self.input_mapping = nn.Linear(hidden, hidden)
        self.output_mapping = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_mapping(x)
        return self.output_mapping(x)


class Net(nn.Module):
    """A network with many dense layers."""

    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        self.layer1 = DenseLayer(hidden)
        self.layer2 = DenseLayer(hidden)
        self.layer3 = DenseLayer(hidden)
        sw.set_comm_fusion(self.layer1, 0)
        sw.set_comm_fusion(self.layer2, 1)
        sw.set_comm_fusion(self.layer3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(x)
        x = self.layer2(x)
        return self.layer3(x)


def fusion_lines(net: nn.Module) -> list[str]:
    """The tutorial's printout: one line per trainable parameter."""
    return [
        f"The parameter {name}'s fusion id is {sw.parameter.comm_fusion_of(item)}"
        for name, item in net.named_parameters()
        if item.requires_grad
    ]


def parallel_step(net: nn.Module, level: str) -> sw.AutoParallel:
    """SGD + MSE train step of `net` under hsdp, every parameter eligible (threshold 0)."""
    optimizer = torch.optim.SGD(net.parameters(), 1e-2)
    loss_fn = nn.MSELoss()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    parallel_net = sw.AutoParallel(train_step, parallel_mode="semi_auto")
    return parallel_net.hsdp(threshold=0, optimizer_level=level)


def batches(hidden: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random global batches of 32 (every rank makes the same ones and passes its rows)."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, hidden, generator=g), torch.randn(32, hidden, generator=g))
        for _ in range(steps)
    ]


def train(hidden: int, steps: int, level: str) -> None:
    """`steps` hsdp steps on random data; the plan and each step's collectives (rank 0)."""
    sw.set_seed(1)
    parallel_net = parallel_step(Net(hidden), level)
    rank0 = get_rank() == 0
    for step, (x, y) in enumerate(batches(hidden, steps)):
        n, rank = sw.communication.get_group_size(), get_rank()
        rows = slice(rank * 32 // n, (rank + 1) * 32 // n)  # this rank's rows (data_parallel)
        with sw.CommRecorder() as rec:
            loss = parallel_net(x[rows], y[rows]).item()
        if step == 0 and rank0:
            print(parallel_net.optimizer_plan, flush=True)
        counts = {k: rec.count(k) for k in ("AllGather", "ReduceScatter", "AllReduce")}
        print(f"step {step}: loss is {loss}, collectives {counts}", flush=True)
        if rank0:
            print(rec.summary(), flush=True)
        if rank0 and step == steps - 1:  # when each bucket moved, relative to compute
            print(rec.timeline(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-only", action="store_true", help="only the tutorial's lines")
    parser.add_argument("--hidden", type=int, default=16, help="layer width of the training part")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--level", default="level1", choices=["level1", "level2", "level3"])
    args = parser.parse_args()

    init()
    net = Net()
    for line in fusion_lines(net):
        print(line, flush=True)
    if not args.print_only:
        train(args.hidden, args.steps, args.level)
    sw.communication.release()


if __name__ == "__main__":
    main()
