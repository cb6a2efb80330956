"""Quick start (seed 002): MatMul / ReLU / MatMul trained with sharding propagation.

Run on 8 workers (``make quick-start``):
``shardwise run --worker_num 8 --local_worker_num 8 --log_dir log_output/quick_start --join True
examples/quick_start.py``, or under Open MPI as the tutorial's ``run_with_mpi.sh`` does:
``MASTER_PORT=29500 mpirun -n 8 --oversubscribe --output-filename log_output/quick_start_mpi
python examples/quick_start.py`` (README.md, "Quick start: sharding propagation", has both
commands in full).

The tutorial's setup with shardwise's MindSpore-style API:

- `get_dataset`: the tutorial's random data (``np.random.seed(1)``): one batch of 2 rows
  (input 32, label 16) yielded 4 times per epoch, read by ``sw.dataset.GeneratorDataset`` with
  the columns ``["input", "label"]``. Every rank reads it whole: under the
  ``"data_parallel"`` dataset strategy those 2 rows are the rank's own rows of a global batch
  of 16 (8 copies of the same rows, so the loss equals one device's loss on the 2 rows).
- `Net`: weights ``w`` (32, 16) and ``w2`` (16, 16) from ``sw.initializer("normal", ...)``;
  only ``matmul`` is annotated, ``((2, 4), (4, 1))``. `main` sets
  ``set_auto_parallel_context(parallel_mode=AUTO_PARALLEL, search_mode="sharding_propagation",
  dataset_strategy="data_parallel")``, so relu is planned ``((2, 4),)`` and matmul2
  ``((2, 4), (4, 1))``, as the tutorial's IR shows.
- `main`: ``sw.Model(net, MSELoss, momentum SGD lr 0.2 / momentum 0.1).train(5, dataset,
  callbacks=[LossMonitor(), ModelCheckpoint(directory=<rank>)], dataset_sink_mode=False)``;
  ``Model`` follows the context and runs its train step through ``sw.AutoParallel``. With
  ``save_graphs=2`` each rank writes ``saved_graph/rank_<r>/step_parallel_begin.ir`` (every
  op's strategy) and ``execute.ir`` (its local shapes, each AllReduce with its rank group, each
  local StridedSlice) and ``plan.html`` (the plan as a web page); rank 0 also draws
  ``plan.png``. Every rank prints ``epoch: 1 step: 1, loss is ...``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_rank, init
from shardwise.train import LossMonitor, ModelCheckpoint

STEP_PER_EPOCH = 4
SINGLE_BATCH_SIZE = 2  # rows per rank and step
IN_DIM, HIDDEN_DIM, OUT_DIM = 32, 16, 16
LEARNING_RATE, MOMENTUM, EPOCH_SIZE = 0.2, 0.1, 5

Batch = tuple[np.ndarray, np.ndarray]


def get_dataset(
    batch_size: int, in_dim: int, out_dim: int, step_per_epoch: int
) -> Callable[[], Iterator[Batch]]:
    """A generator function yielding the same random (input, label) batch `step_per_epoch`
    times. (The tutorial calls its version with the arguments in another order; the
    keywords in `main` give the sizes it describes.)"""
    np.random.seed(1)
    input_data = np.random.rand(batch_size, in_dim).astype(np.float32)
    label_data = np.random.rand(batch_size, out_dim).astype(np.float32)

    def generate() -> Iterator[Batch]:
        for _ in range(step_per_epoch):
            yield input_data, label_data

    return generate


class Net(nn.Module):
    """The tutorial's network: ``matmul`` annotated, ``relu`` and ``matmul2`` propagated."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = sw.Parameter(sw.initializer("normal", [in_dim, hidden_dim]), "w")
        self.weight2 = sw.Parameter(sw.initializer("normal", [hidden_dim, out_dim]), "w2")
        # (2, 4): the input's rows in 2 parts and its columns in 4; (4, 1): the weight's rows
        # in 4 parts. The other two operators get their strategies from sharding propagation.
        self.matmul = sw.ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = sw.ops.ReLU()
        self.matmul2 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.weight)
        out = self.relu(out)
        out = self.matmul2(out, self.weight2)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCH_SIZE)
    parser.add_argument("--save-graphs-path", default="./saved_graph")
    parser.add_argument(
        "--ckpt-root", default=".", help="checkpoints go to <ckpt-root>/<rank id>/ (the seed: .)"
    )
    args = parser.parse_args()

    sw.set_context(save_graphs=2, save_graphs_path=args.save_graphs_path)
    sw.set_auto_parallel_context(
        parallel_mode=sw.ParallelMode.AUTO_PARALLEL,
        search_mode="sharding_propagation",
        dataset_strategy="data_parallel",
    )
    init()  # gloo on CPU (nccl with CUDA); reads shardwise run's or mpirun's environment
    sw.set_seed(1)  # the same initial weights on every rank
    rank_id = get_rank()

    fake_dataset = get_dataset(
        batch_size=SINGLE_BATCH_SIZE,
        in_dim=IN_DIM,
        out_dim=OUT_DIM,
        step_per_epoch=STEP_PER_EPOCH,
    )
    dataset = sw.dataset.GeneratorDataset(fake_dataset, ["input", "label"])

    net = Net(IN_DIM, HIDDEN_DIM, OUT_DIM)
    loss = nn.MSELoss()
    callback = [
        LossMonitor(),
        ModelCheckpoint(directory=os.path.join(args.ckpt_root, str(rank_id))),
    ]
    # MindSpore's Momentum(params, lr, momentum) is torch's SGD with momentum (same update:
    # v = momentum * v + grad; w -= lr * v).
    opt = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

    model = sw.Model(net, loss_fn=loss, optimizer=opt)
    model.train(args.epochs, dataset, callbacks=callback, dataset_sink_mode=False)
    if rank_id == 0:
        print(f"strategies: {model.parallel.strategies()}", flush=True)
    sw.communication.release()


if __name__ == "__main__":
    main()
