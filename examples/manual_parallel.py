"""Manual data parallel on real MNIST: MindSpore's manual-parallel tutorial (seed 004) in shardwise.

Run: ``make data`` once, then
``shardwise run --worker_num 8 --log_dir log_output --join True examples/manual_parallel.py``.

As in the tutorial, a global batch of 32 is split by rank (``shard_size = 32 // device_num``),
each rank computes the loss of its rows, and the loss is all-reduced and averaged. Two
improvements over the tutorial, both on by default:

- each rank *reads* only its rows of every global batch (``MnistDataset(num_shards, shard_id)``
  with ``batch(shard_size)``) instead of reading all 32 and slicing; ``--full-batch`` reads all 32
  and slices inside the network exactly as the tutorial does (same numbers);
- a `DistributedGradReducer` averages the gradients, so the parameters stay identical on all
  ranks and training equals single-device training on batches of 32 (the tutorial's script
  lets each rank follow its own gradient).

Every rank prints the tutorial's loss lines (``epoch: 1 step: 20, loss is ...``) into its
``worker_<rank>.log``; at the end the test accuracy is evaluated (sharded, counts summed over
ranks) and rank 0 saves a loss curve.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init
from shardwise.dataset import transforms, vision

init()
sw.set_seed(1)
cur_rank = get_rank()
batch_size = 32
device_num = get_group_size()
shard_size = batch_size // device_num


class Network(nn.Module):
    def __init__(self, slice_batch: bool) -> None:
        super().__init__()
        self.slice_batch = slice_batch
        self.flatten = nn.Flatten()
        self.layer1 = nn.Linear(28 * 28, 512)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Linear(512, 512)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slice_batch and self.training:
            x = x[cur_rank * shard_size : cur_rank * shard_size + shard_size]
        x = self.flatten(x)
        x = self.relu1(self.layer1(x))
        x = self.relu2(self.layer2(x))
        return self.layer3(x)


class ReduceLoss(nn.Module):
    def __init__(self, slice_batch: bool) -> None:
        super().__init__()
        self.slice_batch = slice_batch
        self.loss = nn.CrossEntropyLoss()
        self.all_reduce = sw.ops.AllReduce()

    def forward(self, data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if self.slice_batch:
            label = label[cur_rank * shard_size : cur_rank * shard_size + shard_size]
        loss_value = self.loss(data, label)
        return self.all_reduce(loss_value) / device_num


def create_dataset(usage: str, full_batch: bool) -> sw.dataset.MnistDataset:
    dataset_path = os.getenv("DATA_PATH", "data/MNIST")
    if full_batch:  # the tutorial: every rank reads the whole global batch
        dataset = sw.dataset.MnistDataset(dataset_path, usage)
    else:  # each rank reads only its rows of every global batch
        dataset = sw.dataset.MnistDataset(
            dataset_path, usage, num_shards=device_num, shard_id=cur_rank
        )
    image_transforms = [
        vision.Rescale(1.0 / 255.0, 0),
        vision.Normalize(mean=(0.1307,), std=(0.3081,)),
        vision.HWC2CHW(),
    ]
    label_transform = transforms.TypeCast(torch.int64)  # torch losses take int64 labels
    dataset = dataset.map(image_transforms, "image")
    dataset = dataset.map(label_transform, "label")
    return dataset.batch(batch_size if full_batch else shard_size)


class LossCurve(sw.train.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.losses.append(float(ctx.net_outputs))


def save_curve(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=0.6)
    ax.set(xlabel="step", ylabel="loss (all-reduced mean)", title=f"MNIST, {device_num} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve: {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--full-batch", action="store_true", help="read all 32 rows and slice")
    parser.add_argument("--plot", default="log_output/loss_curve.png")
    args = parser.parse_args()
    if batch_size % device_num:
        raise SystemExit(f"batch size {batch_size} must divide by the rank count {device_num}")

    net = Network(slice_batch=args.full_batch)
    optimizer = torch.optim.SGD(net.parameters(), 1e-2)
    reducer = sw.nn.DistributedGradReducer(net.parameters())
    model = sw.Model(
        net, ReduceLoss(args.full_batch), optimizer, metrics={"accuracy"}, grad_reducer=reducer
    )
    curve = LossCurve()
    data_set = create_dataset("train", args.full_batch)
    model.train(args.epochs, data_set, callbacks=[sw.train.LossMonitor(20), curve])

    accuracy = model.eval(create_dataset("test", full_batch=False))["accuracy"]
    print(f"rank {cur_rank}: test accuracy {accuracy:.4f} after {args.epochs} epoch(s)", flush=True)
    if cur_rank == 0 and args.plot:
        save_curve(curve.losses, Path(args.plot))
    sw.communication.release()


if __name__ == "__main__":
    main()
