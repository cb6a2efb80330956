"""Per-rank sharding of global batches: rank r's k-th batch is rows [r*b, (r+1)*b) of the k-th
global batch of N*b samples, the shards are disjoint and cover the data, and every rank yields
the same number of batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise.communication as comm
from shardwise.dataset import Dataset, GeneratorDataset
from shardwise.dataset._order import buffer_shuffle, samples_per_rank, shard_positions
from shardwise.testing import simulated_world


def pipeline(n: int, seed: int = 7, **shard: Any) -> Dataset:
    """Rows 0..n-1 (ids), shuffled at the source and through a buffer, under torch seed `seed`."""
    torch.manual_seed(seed)
    ds = GeneratorDataset([(i,) for i in range(n)], "id", **shard)
    return ds.shuffle(16)


def epoch(ds: Dataset) -> list[list[int]]:
    return [row[0].reshape(-1).tolist() for row in ds]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("num_shards", [2, 4, 8])
@pytest.mark.parametrize("n", [96, 101])
def test_rank_batches_are_slices_of_global_batches(num_shards: int, n: int) -> None:
    b = 3
    global_batches = epoch(pipeline(n).batch(num_shards * b, drop_remainder=True))
    counts = set()
    for r in range(num_shards):
        ds = pipeline(n, num_shards=num_shards, shard_id=r).batch(b, drop_remainder=True)
        mine = epoch(ds)
        counts.add(len(mine))
        assert len(ds) == len(mine) == len(global_batches)
        for k, batch in enumerate(mine):
            assert batch == global_batches[k][r * b : (r + 1) * b]
    assert counts == {n // (num_shards * b)}


@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_shards_are_disjoint_and_cover(num_shards: int) -> None:
    n, b = 96, 4  # 96 = 3 global batches of 32, and divisible by 2*4 and 4*4
    shards = [
        flat(epoch(pipeline(n, num_shards=num_shards, shard_id=r).batch(b)))
        for r in range(num_shards)
    ]
    seen = sorted(i for s in shards for i in s)
    assert seen == list(range(n))  # disjoint (no repeats) and covering
    order = flat(epoch(pipeline(n)))
    for r in range(num_shards):
        unbatched = flat(epoch(pipeline(n, num_shards=num_shards, shard_id=r)))
        assert unbatched == order[r::num_shards]  # no batch(): round robin


@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_trailing_partial_global_batch_wraps(num_shards: int) -> None:
    n, b = 45, 4
    order = flat(epoch(pipeline(n)))  # the unsharded global order
    group = num_shards * b
    full = n // group
    padded = (order + order * 8)[: (full + 1) * group]  # wraps to the start, as often as needed
    per_rank = []
    for r in range(num_shards):
        ds = pipeline(n, num_shards=num_shards, shard_id=r).batch(b)
        mine = epoch(ds)
        per_rank.append(mine)
        assert len(mine) == len(ds) == full + 1
        assert all(len(batch) == b for batch in mine)  # equal shapes on every rank
        for k, batch in enumerate(mine):
            assert batch == padded[k * group + r * b : k * group + (r + 1) * b]
    assert sorted({i for m in per_rank for batch in m for i in batch}) == list(range(n))
    real = []  # without the padding rows, the ranks hold each sample exactly once
    for r, mine in enumerate(per_rank):
        ds = pipeline(n, num_shards=num_shards, shard_id=r).batch(b)
        assert (ds.num_shards, ds.shard_id) == (num_shards, r)
        real += flat(mine)[: len(flat(mine)) - ds.get_padding()]
    assert sorted(real) == list(range(n))


def test_epochs_and_seeds_on_shards() -> None:
    a = pipeline(64, seed=1, num_shards=2, shard_id=0).batch(4)
    first, second = epoch(a), epoch(a)
    assert first != second
    again = pipeline(64, seed=1, num_shards=2, shard_id=0).batch(4)
    assert [epoch(again), epoch(again)] == [first, second]
    other_rank_second_epoch = pipeline(64, seed=1, num_shards=2, shard_id=1).batch(4)
    other_rank_second_epoch.set_epoch(1)
    union = sorted(flat(second + epoch(other_rank_second_epoch)))
    assert union == list(range(64))


def test_shuffle_after_batch_keeps_ranks_aligned() -> None:
    n, b, num_shards = 64, 2, 4
    global_batches = epoch(pipeline(n).batch(num_shards * b).shuffle(4))
    for r in range(num_shards):
        mine = epoch(pipeline(n, num_shards=num_shards, shard_id=r).batch(b).shuffle(4))
        assert mine == [g[r * b : (r + 1) * b] for g in global_batches]


def test_shuffle_after_batch_keeps_the_wrapping_batch_last() -> None:
    """10 samples, 2 shards, batch 2: the last global batch wraps around (rank 1's last holds
    rows 0 and 1 again, `get_padding` 2). A shuffle after batch() moved that batch, so dropping
    the padding from the last batch counted rows twice and lost others; it stays last, on
    every rank (the ranks' k-th batches still form one global batch), the others shuffled."""
    orders = set()
    for e in range(4):
        real, firsts = [], []
        for r in range(2):
            ds = pipeline(10, num_shards=2, shard_id=r).batch(2).shuffle(4)
            ds.set_epoch(e)
            mine = epoch(ds)
            real += flat(mine)[: len(flat(mine)) - ds.get_padding()]
            firsts.append(mine[0])
        assert sorted(real) == list(range(10)), e
        orders.add(tuple(firsts[0]))
    assert len(orders) > 1  # (still shuffled from epoch to epoch)


def test_num_samples_is_per_shard() -> None:
    ds = pipeline(100, num_shards=4, shard_id=3, num_samples=10)
    assert len(ds) == 10 and len(epoch(ds)) == 10


def test_shard_argument_errors() -> None:
    with pytest.raises(ValueError, match="shard_id=1 needs num_shards"):
        GeneratorDataset([1], "x", shard_id=1)
    with pytest.raises(ValueError, match=r"shard_id=4 must be an int in \[0, 4\)"):
        GeneratorDataset([1], "x", num_shards=4, shard_id=4)
    with pytest.raises(ValueError, match=r"shard_id=None must be an int"):
        GeneratorDataset([1], "x", num_shards=2)
    with pytest.raises(ValueError, match="num_shards=0 must be an int >= 1, 'auto' or None"):
        GeneratorDataset([1], "x", num_shards=0, shard_id=0)
    with pytest.raises(ValueError, match="leave shard_id=None"):
        GeneratorDataset([1], "x", num_shards="auto", shard_id=0)


def test_auto_without_a_job_is_unsharded() -> None:
    ds = pipeline(10, num_shards="auto").batch(5)
    assert ds.get_shard() == (1, 0) and len(ds) == 2


def test_auto_takes_rank_and_rank0_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-rank job seen from rank 2: the shard comes from communication and the seed from rank 0
    (one Broadcast, on the first iteration only)."""
    broadcasts: list[int] = []

    class FakeBroadcast:
        def __init__(self, root_rank: int) -> None:
            assert root_rank == 0

        def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor]:
            broadcasts.append(int(t.item()))
            return (torch.tensor([11]),)  # rank 0 created its pipeline under seed 11

    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_group_size", lambda group=None: 4)
    monkeypatch.setattr(comm, "process_ranks", lambda: (2,))
    monkeypatch.setattr(comm, "Broadcast", FakeBroadcast)
    auto = pipeline(80, seed=99, num_shards="auto").batch(2)
    assert auto.get_shard() == (4, 2) and len(auto) == 10
    explicit = pipeline(80, seed=11, num_shards=4, shard_id=2).batch(2)
    assert epoch(auto) == epoch(explicit)
    assert epoch(auto) == epoch(explicit)  # the second epoch too
    assert broadcasts == [99]


def test_auto_rejects_a_process_running_several_ranks() -> None:
    with simulated_world(2), pytest.raises(ValueError, match="this process runs 2 ranks"):
        len(pipeline(8, num_shards="auto"))
    with simulated_world(1):  # one rank: its plain rank
        assert pipeline(8, num_shards="auto").get_shard() == (1, 0)


def test_a_per_rank_shard_id_names_the_fixes() -> None:
    """``shard_id=get_rank()`` in a simulated world (one value per rank): the error names it
    and the fixes (it printed the symbolic value as not an int)."""
    with (
        simulated_world(2),
        pytest.raises(ValueError, match=r"holds one value per rank.*world\.rows"),
    ):
        pipeline(8, num_shards=2, shard_id=comm.get_rank())


def test_order_helpers() -> None:
    assert shard_positions(10, 2, 1, 2, drop_remainder=False).tolist() == [2, 3, 6, 7, 0, 1]
    assert shard_positions(10, 2, 0, 2, drop_remainder=True).tolist() == [0, 1, 4, 5]
    assert shard_positions(3, 4, 3, 2, drop_remainder=False).tolist() == [0, 1]  # wraps twice
    assert shard_positions(5, 1, 0, 2, drop_remainder=False).tolist() == [0, 1, 2, 3, 4]
    assert samples_per_rank(10, 2, 2, drop_remainder=False) == 6
    assert samples_per_rank(10, 1, 4, drop_remainder=True) == 8
    items = list(range(20))
    assert buffer_shuffle(items, 5, seed=3) == buffer_shuffle(items, 5, seed=3)
    assert sorted(buffer_shuffle(items, 5, seed=3)) == items


SHARD_OF_A_PROCESS = """
import sys
r, seed, torch_first = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "torch-first"
if torch_first:
    import torch
    if seed:
        torch.manual_seed(seed)
import shardwise as sw
import torch
if seed and not torch_first:
    torch.manual_seed(seed)
ds = sw.dataset.GeneratorDataset([(i,) for i in range(40)], "id", shuffle=True, num_shards=2,
                                 shard_id=r)
print([int(row[0]) for row in ds])
"""


def shard_of_a_process(rank: int, seed: int = 0, order: str = "torch-first") -> list[int]:
    """Rank `rank`'s shard in a fresh process that seeds torch with `seed` (0: never), torch
    imported (and seeded) before shardwise or after it (`order`)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SHARD_OF_A_PROCESS, str(rank), str(seed), order],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shard: list[int] = eval(out)
    return shard


def test_unseeded_processes_read_disjoint_shards() -> None:
    """Two processes that never seed torch (each draws its own random seed) read disjoint
    shards covering the data: the pipeline takes MindSpore's constant seed until the script
    seeds torch (each rank shuffled by its own seed, and shards overlapped)."""
    shards = [shard_of_a_process(r) for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(40))
    assert shards[0] != sorted(shards[0])  # (shuffled)


def test_a_seed_orders_the_data_whatever_the_import_order() -> None:
    """torch seeded before shardwise is imported, or after it with shardwise imported first
    (torch then imported lazily): the order is the seed's (the same in both), not the
    unseeded default."""
    seeded = shard_of_a_process(0, 7, "torch-first")
    assert shard_of_a_process(0, 7, "shardwise-first") == seeded
    assert seeded != shard_of_a_process(0)


def test_a_seeded_script_orders_by_its_seed() -> None:
    torch.manual_seed(11)
    a = epoch(GeneratorDataset([(i,) for i in range(40)], "id", num_shards=2, shard_id=0))
    torch.manual_seed(12)
    b = epoch(GeneratorDataset([(i,) for i in range(40)], "id", num_shards=2, shard_id=0))
    torch.manual_seed(11)
    c = epoch(GeneratorDataset([(i,) for i in range(40)], "id", num_shards=2, shard_id=0))
    assert a == c != b
