"""Worker for test_manual_parallel_real.py: seed-004-style manual data parallel on a small
synthetic MNIST-shaped set; each rank reads only its rows of every global batch of 32, the loss
is all-reduced and averaged, gradients are averaged by DistributedGradReducer.

Writes ``<out>/rank_<r>.json``: per-step losses and the final parameters (as lists)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import shardwise as sw
from shardwise.communication import get_group_size, get_rank, init

sys.path.insert(0, str(Path(__file__).parent))
from manual_dp_common import GLOBAL_BATCH, ReduceLoss, make_network, make_samples


def main() -> None:
    out = Path(sys.argv[1])
    init()
    checks(out)
    sw.communication.release()


def checks(out: Path) -> None:
    """Every check of this worker, in a job that has called ``init()`` (four_ranks_worker.py
    runs them in the tests' one 4-process job)."""
    rank, n = get_rank(), get_group_size()
    sw.set_seed(5)
    net = make_network()
    data = sw.dataset.GeneratorDataset(
        make_samples(), ["image", "label"], shuffle=True, num_shards=n, shard_id=rank
    ).batch(GLOBAL_BATCH // n)
    opt = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.9)
    losses: list[float] = []

    class Record(sw.train.Callback):
        def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
            losses.append(float(ctx.net_outputs))

    model = sw.Model(
        net, ReduceLoss(), opt, grad_reducer=sw.nn.DistributedGradReducer(net.parameters())
    )
    model.train(2, data, callbacks=[Record()])
    params = {k: v.tolist() for k, v in net.state_dict().items()}
    (out / f"rank_{rank}.json").write_text(json.dumps({"losses": losses, "params": params}))


if __name__ == "__main__":
    main()
