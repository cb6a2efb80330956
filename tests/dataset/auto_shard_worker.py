"""Worker for test_auto_shard_real.py: ``num_shards="auto"`` on real gloo processes.

Each rank seeds torch differently on purpose; the pipeline must still agree on rank 0's order
(one broadcast), read only its own rows, and match an explicit-shard pipeline built under rank
0's seed. Prints ``CHECK auto-shard OK``.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.dataset import Dataset, GeneratorDataset

N_ROWS, BATCH = 50, 3


def build(**shard: object) -> Dataset:
    ds = GeneratorDataset([(i,) for i in range(N_ROWS)], "id", **shard)  # type: ignore[arg-type]
    return ds.shuffle(8).batch(BATCH)


def main() -> None:
    sw.communication.init()
    rank, size = sw.communication.get_rank(), sw.communication.get_group_size()
    torch.manual_seed(1000 + rank)  # ranks disagree on purpose
    auto = build(num_shards="auto")
    assert auto.get_shard() == (size, rank), auto.get_shard()
    mine = [b[0] for b in auto]
    torch.manual_seed(1000)  # rank 0's seed
    explicit = [b[0] for b in build(num_shards=size, shard_id=rank)]
    assert all(torch.equal(a, e) for a, e in zip(mine, explicit, strict=True)), (mine, explicit)
    everything = sw.ops.AllGather()(torch.cat(mine))
    assert sorted(set(everything.tolist())) == list(range(N_ROWS)), everything.tolist()
    print("CHECK auto-shard OK", flush=True)
    sw.communication.release()


if __name__ == "__main__":
    main()
