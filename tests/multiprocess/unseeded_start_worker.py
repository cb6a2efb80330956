"""Checks of a job whose script never seeds torch (run first in the 2-process job of
two_ranks_worker.py): ``init()`` gives every rank rank 0's torch random state, so a network built
after it starts from the same weights on every rank (each process drew its own seed: the ranks
trained different replicas for ever, their averaged loss hiding it), and an unseeded
dataset's shards stay disjoint."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw


def checks() -> None:
    """Run in a job that has called ``init()`` and not seeded torch."""
    net = nn.Linear(8, 4)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).reshape(1, -1)
    every = sw.ops.AllGather()(flat)
    torch.testing.assert_close(every[0], every[1], rtol=0, atol=0)
    print("CHECK unseeded_weights_alike OK", flush=True)
    from shardwise.dataset.pipeline import DEFAULT_SEED, pipeline_seed

    assert pipeline_seed() == DEFAULT_SEED  # (still unseeded: MindSpore's constant, every rank)
    rank, n = sw.communication.get_rank(), sw.communication.get_group_size()
    data = sw.dataset.GeneratorDataset([(i,) for i in range(20)], "id", num_shards=n, shard_id=rank)
    mine = torch.tensor([int(row[0]) for row in data])
    ids = sorted(sw.ops.AllGather()(mine).tolist())
    assert ids == list(range(20)), ids
    print("CHECK unseeded_shards_disjoint OK", flush=True)
