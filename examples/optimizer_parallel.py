"""Optimizer parallel (seed 000) on MNIST: the tutorial's MLP with ``AutoParallel(...).hsdp()``.

Run: ``make data`` once, then
``shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output --join True
examples/optimizer_parallel.py`` (``make demo-optimizer-parallel``), or plain
``python examples/optimizer_parallel.py`` (one rank).

As in the tutorial, the network (Flatten, Dense 784-512, 512-512, 512-10, ReLU) and its SGD
optimizer are built inside ``no_init_parameters()`` (nothing is allocated until the first step),
the three layers get fusion ids 0, 1 and 2, and the train step is the single-device one
(``loss.backward(); optimizer.step(); optimizer.zero_grad()``). ``AutoParallel(train_step,
parallel_mode="semi_auto").hsdp()`` runs it data parallel and shards the optimizer. The dataset
is read sharded (``num_shards=n, shard_id=rank``, batches of 32 // n): each rank reads only its
own rows of every global batch of 32, which is what the default
``dataset_strategy("data_parallel")`` expects (MindSpore's convention; the tutorial's unsharded
dataset would instead need ``dataset_strategy("full_batch")``, and every rank would then read
and transform the whole batch only to use 1/n of it; beyond 32 ranks the global batch is one
row per rank, `global_batch`). each parameter of at least 64 KB whose dim 0
divides the ranks is stored, updated and reduce-scattered as one 1/n shard per rank and gathered
for compute (``--level``: when). Fusion ids pick the buckets: id 0 one collective per parameter,
ids 1 and 2 one fused collective per layer. Rank 0 prints the optimizer plan after the first
step; every rank prints the tutorial's lines ``epoch: 0, step: 0, loss is 2.30...``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_rank, init
from shardwise.dataset import transforms, vision

BATCH_SIZE = 32


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Linear(28 * 28, 512)
        self.layer2 = nn.Linear(512, 512)
        self.layer3 = nn.Linear(512, 10)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu(x)
        x = self.layer2(x)
        x = self.relu(x)
        return self.layer3(x)


def synthetic_rows(rows: int) -> list[tuple[torch.Tensor, int]]:
    """`rows` deterministic MNIST-shaped samples: uint8 images (28, 28, 1) and labels 0-9."""
    g = torch.Generator().manual_seed(4)
    images = torch.randint(0, 256, (rows, 28, 28, 1), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (rows,), generator=g)
    return [(images[i], int(labels[i])) for i in range(rows)]


def create_dataset(
    batch_size: int, data_path: str, synthetic: int = 0, num_shards: int = 1, shard_id: int = 0
) -> Any:
    """The tutorial's pipeline, read sharded: rank `shard_id`'s rows of each global batch of
    `batch_size` (all of them with the defaults, one process)."""
    n, rank = num_shards, shard_id
    if batch_size % n:
        raise ValueError(f"the global batch {batch_size} must divide by the {n} ranks")
    if synthetic:
        dataset = sw.dataset.GeneratorDataset(
            synthetic_rows(synthetic),
            ["image", "label"],
            shuffle=False,
            num_shards=n,
            shard_id=rank,
        )
    else:
        dataset = sw.dataset.MnistDataset(data_path, num_shards=n, shard_id=rank)
    image_transforms = [
        vision.Rescale(1.0 / 255.0, 0),
        vision.Normalize(mean=(0.1307,), std=(0.3081,)),
        vision.HWC2CHW(),
    ]
    label_transform = transforms.TypeCast(torch.int64)
    dataset = dataset.map(image_transforms, "image")
    dataset = dataset.map(label_transform, "label")
    return dataset.batch(batch_size // n)


def global_batch(n: int) -> int:
    """The tutorial's global batch of 32, raised to a multiple of `n` when `n` ranks do not
    divide it (more than 32 ranks: one row each at least, e.g. for ``shardwise plan
    --device_num 1024``)."""
    return BATCH_SIZE if BATCH_SIZE % n == 0 else -(-BATCH_SIZE // n) * n


def build() -> tuple[Network, torch.optim.Optimizer]:
    """Network and optimizer with delayed initialization, fusion ids 0 / 1 / 2."""
    with sw.no_init_parameters():
        net = Network()
        optimizer = torch.optim.SGD(net.parameters(), 1e-2)
    sw.set_comm_fusion(net.layer1, 0)
    sw.set_comm_fusion(net.layer2, 1)
    sw.set_comm_fusion(net.layer3, 2)
    return net, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1, help="the tutorial trains 10")
    parser.add_argument("--steps", type=int, default=-1, help="steps per epoch (-1: all)")
    parser.add_argument("--level", default="level1", choices=["level1", "level2", "level3"])
    parser.add_argument("--data", default=os.getenv("DATA_PATH", "data/MNIST"))
    parser.add_argument(
        "--synthetic", type=int, default=0, help="N > 0: N deterministic random rows, no MNIST"
    )
    parser.add_argument("--losses-out", default="", help="write rank 0's losses here (tests)")
    args = parser.parse_args()

    init()
    sw.set_seed(1)
    net, optimizer = build()
    loss_fn = nn.CrossEntropyLoss()

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(net(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    parallel_net = sw.AutoParallel(train_step, parallel_mode="semi_auto")
    parallel_net.hsdp(optimizer_level=args.level)
    n, rank = sw.communication.get_group_size(), get_rank()
    data_set = create_dataset(global_batch(n), args.data, args.synthetic, n, rank)

    losses: list[float] = []
    for epoch in range(args.epochs):
        for i, (image, label) in enumerate(data_set):
            if i == args.steps:
                break
            loss_output = parallel_net(image, label).item()
            if epoch == 0 and i == 0 and get_rank() == 0:
                print(parallel_net.optimizer_plan, flush=True)
            if i % 10 == 0:
                print(f"epoch: {epoch}, step: {i}, loss is {loss_output}", flush=True)
            losses.append(loss_output)
    if args.losses_out and get_rank() == 0:
        with open(args.losses_out, "w", encoding="utf-8") as f:
            f.write("\n".join(repr(x) for x in losses))
    sw.communication.release()


if __name__ == "__main__":
    main()
