"""Worker for test_checkpoint_resume_real.py: train a small MLP with Adam for some steps under
one plan, optionally after loading a distributed checkpoint of another plan, and save this
rank's checkpoint.

Plans: ``tp`` (4 ranks: dp 2 x mp 2, first Linear column parallel, second row parallel,
optimizer parallel level 1 over dp), ``dp`` (any count: data parallel, optimizer parallel
level 3) and ``dp-mode`` (``parallel_mode="data_parallel"`` with hsdp, ``--threshold`` KB: each
parameter above it updated by its owner rank, whose file alone holds its optimizer state);
``--no-bias``: Linears without bias. The checkpoint of another plan is loaded with
`load_distributed` before the first step (``--load``), or, already transformed for this plan,
rank by rank with the plain ``load_checkpoint`` after planning (``--load-plain``). Rank 0 writes
the global losses (one per line) to ``--losses-out`` and the plan's parameter strategy file to
``--strategy-out``. Several legs run one after another in one job when their argument lists are
separated by ``+`` (each builds its network and optimizer afresh: one process start per job).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

ROWS, FEATURES, CLASSES = 8, 16, 8


class Net(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32, bias=bias)
        self.fc2 = nn.Linear(32, CLASSES, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of every step of the whole run (the same in every leg)."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(ROWS, FEATURES, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g))
        for _ in range(steps)
    ]


def build(bias: bool = True) -> tuple[Net, torch.optim.Optimizer]:
    sw.set_seed(0)
    net = Net(bias)
    return net, torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.9))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", choices=["tp", "dp", "dp-mode"], required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--load", help="load_distributed from here before the first step")
    parser.add_argument("--load-plain", help="plan, then load rank_<r>/ckpt-1_<first> as is")
    parser.add_argument("--save", required=True)
    parser.add_argument("--losses-out", required=True)
    parser.add_argument("--strategy-out")
    parser.add_argument("--threshold", type=float, default=0.5, help="KB, dp-mode's hsdp")
    parser.add_argument("--no-bias", action="store_true", help="Linears without bias")
    return parser


def legs(argv: list[str]) -> list[argparse.Namespace]:
    """The legs of `argv`: argument lists separated by ``+``."""
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "+":
            groups.append([])
        else:
            groups[-1].append(arg)
    return [parser().parse_args(group) for group in groups]


def run_leg(args: argparse.Namespace) -> None:
    """Build, optionally load, train and save one leg."""
    n, rank = get_group_size(), get_rank()
    net, opt = build(not args.no_bias)
    if args.plan == "tp":
        sw.shard(net.fc1, in_strategy=((2, 1), (2, 1)))  # column parallel
        sw.shard(net.fc2, in_strategy=((2, 2), (1, 2)))  # row parallel
    if args.load:  # before the first step, as users write it
        assert sw.checkpoint.load_distributed(net, args.load, opt) == ([], [])

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if args.plan == "dp-mode":  # (0.5 KB: the weights get owners, the biases do not)
        step = sw.AutoParallel(train_step, parallel_mode="data_parallel")
        step.hsdp(threshold=args.threshold)
    else:
        step = sw.AutoParallel(train_step, parallel_mode="semi_auto")
        step.hsdp(threshold=0, optimizer_level="level1" if args.plan == "tp" else "level3")
    if args.load_plain:  # a checkpoint already cut for this plan: each rank loads its own file
        step.plan(shapes=[(ROWS, FEATURES), (ROWS,)], dtypes=[torch.float32, torch.int64])
        ckpt = sw.load_checkpoint(
            Path(args.load_plain) / f"rank_{rank}" / f"ckpt-1_{args.first}.safetensors"
        )
        assert sw.load_param_into_net(net, ckpt, strict_load=True) == ([], [])
        sw.checkpoint.load_optimizer_state(opt, ckpt, net)
    losses = []
    k = ROWS // n
    for x, y in batches(args.first + args.steps)[args.first :]:
        losses.append(
            float(step(x[rank * k : (rank + 1) * k], y[rank * k : (rank + 1) * k]).detach())
        )
    path = Path(args.save) / f"rank_{rank}" / f"ckpt-1_{args.first + args.steps}.safetensors"
    sw.save_checkpoint(net, path, step=args.first + args.steps, optimizer=opt)
    if rank == 0:
        Path(args.losses_out).write_text("".join(f"{v!r}\n" for v in losses))
        if args.strategy_out:
            step.save_param_strategy_file(args.strategy_out)


def main() -> None:
    todo = legs(sys.argv[1:])
    init()
    for args in todo:
        run_leg(args)
    sw.communication.release()


if __name__ == "__main__":
    main()
