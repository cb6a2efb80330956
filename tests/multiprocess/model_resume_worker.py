"""Worker of test_model_resume_real.py: in one job, a tensor-parallel `sw.Model` trains 3 epochs
straight; a second one trains 1 epoch saving `ModelCheckpoint` files, into one directory for
all ranks (``ckpt/rank_<r>/``) and into each rank's own (``seed/<r>/rank_<r>/``, seed 002's
``ModelCheckpoint(directory=str(rank_id))``); a third and a fourth resume from this rank's file
of each (`sw.train.resume`) and train 2 more. Rank 0 writes the losses as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import shardwise as sw

FEATURES, CLASSES, ROWS = 6, 3, 16


def build() -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    sw.shard(net[0], in_strategy=((1, 1), (2, 1)))  # (column parallel over the 2 ranks)
    sw.shard(net[2], in_strategy=((1, 2), (1, 2)))  # (row parallel)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    return net, opt


class Losses(sw.train.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_step_end(self, run_context: Any) -> None:
        self.seen.append(float(run_context.net_outputs))


def data(rank: int, n: int) -> Any:
    g = np.random.default_rng(3)
    x = g.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = g.integers(0, CLASSES, ROWS)
    rows = [(x[i], np.int64(y[i])) for i in range(ROWS)]
    source = sw.dataset.GeneratorDataset(rows, ["x", "y"], shuffle=False)
    return source.batch(4)  # (full_batch: every rank the whole batch of 4)


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    sw.communication.init()
    rank, n = sw.communication.get_rank(), sw.communication.get_group_size()
    sw.set_auto_parallel_context(
        parallel_mode=sw.ParallelMode.SEMI_AUTO_PARALLEL, dataset_strategy="full_batch"
    )
    losses = {}
    seed = folder.parent / "seed" / str(rank)  # (each rank's own directory)
    for run in ("straight", "first", "resumed", "seed"):
        net, opt = build()
        model, seen = sw.Model(net, nn.CrossEntropyLoss(), opt), Losses()
        saver = sw.train.ModelCheckpoint(
            "net", folder, sw.train.CheckpointConfig(save_checkpoint_steps=4)
        )
        if run == "straight":
            model.train(3, data(rank, n), callbacks=[seen])
        elif run == "first":
            own = sw.train.ModelCheckpoint("net", seed, sw.train.CheckpointConfig(4))
            model.train(1, data(rank, n), callbacks=[seen, saver, own])
        else:
            where = folder if run == "resumed" else seed
            done = sw.train.resume(model, where / f"rank_{rank}" / "net-1_4.safetensors")
            model.train(3, data(rank, n), callbacks=[seen], initial_epoch=done)
        losses[run] = seen.seen
        torch.distributed.barrier()  # (the resume reads every rank's file: all written)
    if rank == 0:
        out.write_text(json.dumps(losses))
    sw.communication.release()


if __name__ == "__main__":
    main()
