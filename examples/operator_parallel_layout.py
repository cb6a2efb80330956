"""Higher-order operator-level parallel (seed 003, Layout version) on MNIST.

Run: ``make data`` once, then ``shardwise run --worker_num 8 --log_dir log_output --join True
examples/operator_parallel_layout.py``.

As `operator_parallel.py`, but the two MatMuls are sharded with named-axis layouts, exactly as
in the tutorial (8 workers):

    layout = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))
    layout2 = sw.Layout((8,), ("tp",))
    matmul1 = MatMul().shard((layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None")))
    matmul2 = MatMul().shard((layout2("None", "tp"), layout2("tp", "None")))

x's rows are split by mp, its columns by (sp, dp) with sp outer; fc1_weight's rows by (sp, dp).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import shardwise as sw

sys.path.insert(0, str(Path(__file__).parent))
from operator_parallel import main


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flatten = sw.ops.Flatten()
        self.fc1_weight = sw.Parameter(sw.initializer("normal", [28 * 28, 512], torch.float32))
        self.fc2_weight = sw.Parameter(sw.initializer("normal", [512, 512], torch.float32))
        self.fc3_weight = sw.Parameter(sw.initializer("normal", [512, 10], torch.float32))
        layout = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))
        layout2 = sw.Layout((8,), ("tp",))
        self.matmul1 = sw.ops.MatMul().shard(
            (layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None"))
        )
        self.relu1 = sw.ops.ReLU().shard(((4, 1),))
        self.matmul2 = sw.ops.MatMul().shard((layout2("None", "tp"), layout2("tp", "None")))
        self.relu2 = sw.ops.ReLU().shard(((8, 1),))
        self.matmul3 = sw.ops.MatMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        x = self.matmul1(x, self.fc1_weight)
        x = self.relu1(x)
        x = self.matmul2(x, self.fc2_weight)
        x = self.relu2(x)
        return self.matmul3(x, self.fc3_weight)


def make_network(device_num: int) -> Network:
    if device_num != 8:
        raise SystemExit(f"the tutorial's layouts need 8 workers (got {device_num})")
    return Network()


if __name__ == "__main__":
    main(make_network)
