"""Operator-level parallel (seed 003) on MNIST: MatMul / ReLU with shard strategies.

Run: ``make data`` once, then
``shardwise run --worker_num 8 --log_dir log_output --join True examples/operator_parallel.py``.

The network is the tutorial's: ``MatMul().shard(((2, 4), (4, 1)))``, ``ReLU().shard(((4, 1),))``,
``MatMul().shard(((1, 8), (8, 1)))``, ``ReLU().shard(((8, 1),))`` and an unannotated MatMul
(data parallel), weights from ``sw.initializer("normal", ...)``. With 8 workers the strategies
are exactly the tutorial's; with 2 or 4 workers they are scaled down (same shape of split, see
`strategies`). `sw.AutoParallel` plans every primitive, cuts each weight to this rank's block
and inserts the collectives the strategies imply. Each rank reads only its rows of every global
batch of 32 (data-parallel input; one row per rank beyond 32 ranks), the loss is the mean over
the global batch on every rank, and every rank prints the tutorial's lines ``epoch: 0, step: 0,
loss is 2.30...``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init
from shardwise.dataset import transforms, vision

Strategy = tuple[tuple[Any, ...], ...]


def strategies(device_num: int) -> dict[str, Strategy]:
    """The tutorial's strategies for 8 devices, scaled for 2 and 4; on a multiple of 8
    devices the tutorial's (each op's strategy repeated over the other devices, which split
    the batch: ``shardwise plan --device_num 1024``)."""
    if device_num % 8 == 0:
        return {
            "matmul1": ((2, 4), (4, 1)),
            "relu1": ((4, 1),),
            "matmul2": ((1, 8), (8, 1)),
            "relu2": ((8, 1),),
        }
    if device_num in (2, 4):
        half = device_num // 2
        return {
            "matmul1": ((2, half), (half, 1)),
            "relu1": ((half, 1),),
            "matmul2": ((1, device_num), (device_num, 1)),
            "relu2": ((device_num, 1),),
        }
    raise SystemExit(f"run with 2, 4 or a multiple of 8 workers (got {device_num})")


class Network(nn.Module):
    def __init__(self, plan: dict[str, Strategy]) -> None:
        super().__init__()
        self.flatten = sw.ops.Flatten()
        self.fc1_weight = sw.Parameter(sw.initializer("normal", [28 * 28, 512], torch.float32))
        self.fc2_weight = sw.Parameter(sw.initializer("normal", [512, 512], torch.float32))
        self.fc3_weight = sw.Parameter(sw.initializer("normal", [512, 10], torch.float32))
        self.matmul1 = sw.ops.MatMul().shard(plan["matmul1"])
        self.relu1 = sw.ops.ReLU().shard(plan["relu1"])
        self.matmul2 = sw.ops.MatMul().shard(plan["matmul2"])
        self.relu2 = sw.ops.ReLU().shard(plan["relu2"])
        self.matmul3 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        x = self.matmul1(x, self.fc1_weight)
        x = self.relu1(x)
        x = self.matmul2(x, self.fc2_weight)
        x = self.relu2(x)
        return self.matmul3(x, self.fc3_weight)


def global_batch(device_num: int) -> int:
    """The tutorial's global batch of 32; beyond 32 devices one row per rank."""
    return max(32, device_num)


def create_dataset(batch_size: int, rank: int, device_num: int) -> sw.dataset.MnistDataset:
    """This rank's rows of every global batch of `batch_size` (data-parallel input)."""
    dataset_path = os.getenv("DATA_PATH", "data/MNIST")
    dataset = sw.dataset.MnistDataset(dataset_path, num_shards=device_num, shard_id=rank)
    image_transforms = [
        vision.Rescale(1.0 / 255.0, 0),
        vision.Normalize(mean=(0.1307,), std=(0.3081,)),
        vision.HWC2CHW(),
    ]
    dataset = dataset.map(image_transforms, "image")
    dataset = dataset.map(transforms.TypeCast(torch.int64), "label")
    return dataset.batch(batch_size // device_num)


def train(network_factory: Any, epochs: int, max_steps: int) -> list[float]:
    """The tutorial's training loop; returns rank 0's losses (printed every 10 steps)."""
    init()
    sw.set_seed(1)
    rank, device_num = get_rank(), get_group_size()
    net = network_factory(device_num)
    parallel_net = sw.AutoParallel(net, parallel_mode="semi_auto")
    optimizer = torch.optim.SGD(net.parameters(), 1e-2)
    loss_fn = nn.CrossEntropyLoss()
    data_set = create_dataset(global_batch(device_num), rank, device_num)
    losses = []
    for epoch in range(epochs):
        for i, (image, label) in enumerate(data_set):
            if i == max_steps:
                break
            logits = parallel_net(image)
            loss = sw.ops.AllReduce()(loss_fn(logits, label)) / device_num
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            value = float(loss.detach())
            losses.append(value)
            if i % 10 == 0:
                print(f"epoch: {epoch}, step: {i}, loss is {value}", flush=True)
    return losses


def main(network_factory: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200, help="steps per epoch (-1: all)")
    parser.add_argument("--losses-out", default="", help="write rank 0's losses here (tests)")
    parser.add_argument("--save-graphs", type=int, default=0, help="IR dumps, level 0-3")
    parser.add_argument("--save-graphs-path", default="./saved_graph")
    args = parser.parse_args()
    sw.set_context(save_graphs=args.save_graphs, save_graphs_path=args.save_graphs_path)
    factory = network_factory or (lambda n: Network(strategies(n)))
    losses = train(factory, args.epochs, args.max_steps)
    if args.losses_out and get_rank() == 0:
        with open(args.losses_out, "w", encoding="utf-8") as f:
            f.write("\n".join(repr(x) for x in losses))
    sw.communication.release()


if __name__ == "__main__":
    main()
