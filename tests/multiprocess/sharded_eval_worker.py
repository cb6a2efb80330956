"""Checks of `Model.eval` on a dataset sharded over real ranks (run in the 2-process job of
two_ranks_worker.py): the short last global batch leaves rank 1 only wrap-around padding, which
eval trims away; the "loss" metric was NaN there (the mean loss of an empty batch) and, on an
uneven last batch, each rank's part counted as a whole batch. Both equal one device's eval of
the same global batches now."""

from __future__ import annotations

import math

import torch
from torch import nn

import shardwise as sw
from shardwise.dataset import GeneratorDataset


def checks() -> None:
    """Run in a job that has called ``init()``."""
    rank, n = sw.communication.get_rank(), sw.communication.get_group_size()
    g = torch.Generator().manual_seed(7)
    rows = [(torch.randn(3, generator=g), torch.randint(0, 2, (), generator=g)) for _ in range(5)]
    torch.manual_seed(1)
    net, loss_fn = nn.Linear(3, 2), nn.CrossEntropyLoss()
    metrics = {"loss", "accuracy"}
    whole = GeneratorDataset(rows, ["x", "y"], shuffle=False).batch(2 * n)
    want = sw.Model(net, loss_fn, metrics=metrics).eval(whole)  # (global batches of 4, then 1)
    mine = GeneratorDataset(rows, ["x", "y"], shuffle=False, num_shards=n, shard_id=rank)
    mine = mine.batch(2)
    assert mine.get_padding() == (1, 2)[rank], mine.get_padding()  # (rank 1: padding only)
    got = sw.Model(net, loss_fn, metrics=metrics).eval(mine)
    assert got["accuracy"] == want["accuracy"], (got, want)
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6), (got, want)  # (float32 losses)
    print("CHECK sharded_eval_loss OK", flush=True)
