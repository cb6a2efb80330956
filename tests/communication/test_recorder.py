"""CommRecorder: one record per collective call with the ring/pairwise byte bound."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.communication import bytes_bound, create_group
from shardwise.testing import CommRecorder, simulated_world

N = 4
FLOATS = 8 * 6  # a float32 [8, 6] input: 192 bytes
S = FLOATS * 4


@pytest.mark.parametrize(
    ("make", "kind", "expected_bytes"),
    [
        (lambda: sw.ops.AllReduce(), "AllReduce", 2 * (N - 1) * S // N),
        (lambda: sw.ops.AllGather(), "AllGather", (N - 1) * S),
        (lambda: sw.ops.ReduceScatter(), "ReduceScatter", (N - 1) * S // N),
        (lambda: sw.ops.AlltoAll(N, 0, 1), "AlltoAll", (N - 1) * S // N),
        (lambda: sw.ops.Broadcast(0), "Broadcast", (N - 1) * S // N),
    ],
)
def test_one_record_per_call_with_bound(make, kind: str, expected_bytes: int) -> None:  # type: ignore[no-untyped-def]
    with simulated_world(N) as world, CommRecorder() as rec:
        x = world.rank_map(lambda r: torch.randn(8, 6))
        make()(x)
        make()(x)
    assert rec.count() == 2
    assert rec.count(kind) == 2
    r = rec.records[0]
    assert (r.kind, r.group, r.dtype, r.numel, r.phase) == (
        kind,
        (0, 1, 2, 3),
        torch.float32,
        FLOATS,
        "forward",
    )
    assert r.bytes_sent == expected_bytes
    assert rec.total_bytes() == 2 * expected_bytes
    assert r.seconds >= 0


def test_subgroup_bytes_use_group_size() -> None:
    with simulated_world(8) as world, CommRecorder() as rec:
        create_group("quad", [0, 2, 4, 6])
        sw.ops.AllReduce(group="quad")(world.rank_map(lambda r: torch.ones(16)))
    assert rec.records[0].group == (0, 2, 4, 6)
    assert rec.records[0].bytes_sent == 2 * 3 * 64 // 4


def test_neighbor_exchange_v2_counts_halo_bytes() -> None:
    """1 x 2 grid: each rank sends one 1-column border of a [1, 2, 4, 4] float32 tensor."""
    with simulated_world(2) as world, CommRecorder() as rec:
        n = world.per_rank_int
        right = n([1, -1])
        left = n([-1, 0])
        ids = [-1, -1, right, -1, -1, -1, left, -1]
        sw.ops.NeighborExchangeV2(ids, [0, 0, 1, 1], ids, [0, 0, 1, 1])(torch.ones(1, 2, 4, 4))
    assert rec.records[0].bytes_sent == 1 * 2 * 4 * 1 * 4


def test_nested_recorders_and_summary() -> None:
    with simulated_world(2) as world, CommRecorder() as outer:
        x = world.rank_map(lambda r: torch.ones(4)).requires_grad_()
        with CommRecorder() as inner:
            sw.ops.AllReduce()(x).sum().backward()
        sw.ops.AllGather()(x)
    assert inner.count() == 2 and outer.count() == 3
    assert inner.kinds()[("AllReduce", "backward", (0, 1))] == 1
    text = outer.summary()
    assert "AllGather" in text and "backward" in text
    assert str(outer.records[0]).startswith("AllReduce(forward) group=[0, 1] float32[4]")


def test_nothing_recorded_outside_a_recorder() -> None:
    with simulated_world(2):
        sw.ops.AllReduce()(torch.ones(2))
        with CommRecorder() as rec:
            pass
    assert rec.count() == 0


def test_bytes_bound_table() -> None:
    assert bytes_bound("AllReduce", 1024, 4) == 1536
    assert bytes_bound("AllGather", 256, 4) == 768
    assert bytes_bound("ReduceScatter", 1024, 4) == 768
    assert bytes_bound("AllReduce", 1024, 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'Gather'"):
        bytes_bound("Gather", 1, 2)
