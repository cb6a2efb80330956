"""`process_ranks`, `holds_several_ranks`, `rank_value`, `own_group`, `rank_parts`,
`file_rank`, `shared_value`: the same questions answered outside a job, in a 1-rank job (one
rank per process, as in a real job) and in a simulated world (one process running every rank).
Real multi-rank jobs run them through tests/multiprocess (redistribution, optimizer parallel,
data parallel, delayed init)."""

from __future__ import annotations

import re

import pytest
import torch

from shardwise import communication as comm
from shardwise.testing import assert_matches_single_device, simulated_world


def test_outside_a_job() -> None:
    assert comm.process_ranks() == (0,)
    assert not comm.holds_several_ranks()
    assert comm.file_rank() == (0, 1)
    t = torch.ones(2)
    assert comm.rank_parts(t) == [t]
    assert comm.shared_value(t) is t
    with pytest.raises(RuntimeError, match="init"):
        comm.rank_value(lambda r: r)
    with pytest.raises(RuntimeError, match="init"):
        comm.own_group(lambda r: [r])


def test_one_rank_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK_TABLE_FILE"):
        monkeypatch.delenv(name, raising=False)
    comm.init()
    try:
        assert comm.process_ranks() == (0,)
        assert not comm.holds_several_ranks()
        assert comm.file_rank() == (0, 1)
        got = comm.rank_value(lambda r: {"r": r + 5, "t": torch.full((1,), float(r))})
        assert got["r"] == 5 and torch.equal(got["t"], torch.zeros(1))
        assert comm.own_group(lambda r: (r,)) == (0,)
        t = torch.ones(2)
        assert comm.rank_parts(t) == [t]
    finally:
        comm.release()


def test_every_rank_in_one_process() -> None:
    with simulated_world(4) as world:
        assert comm.process_ranks() == (0, 1, 2, 3)
        assert comm.holds_several_ranks()
        assert comm.file_rank() == (0, 1)
        coord = comm.rank_value(lambda r: r % 2)  # a per-rank int
        x = world.rank_map(lambda r: torch.arange(4.0))
        assert_matches_single_device(
            x.narrow(0, coord * 2, 2), lambda r: torch.arange(4.0)[r % 2 * 2 :][:2]
        )
        same = comm.rank_value(lambda r: (3, "dp"))  # equal on every rank: plain values
        assert same == (3, "dp") and type(same[0]) is int
        blocks = comm.rank_value(lambda r: {"w": torch.full((2,), float(r)), "k": r})
        assert_matches_single_device(blocks["w"], lambda r: torch.full((2,), float(r)))
        assert [float(p[0]) for p in comm.rank_parts(blocks["w"])] == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(ValueError, match="only ints and tensors may differ"):
            comm.rank_value(lambda r: f"rank {r}")
        # the rank itself: a Python branch on it cannot take each rank's way (it took one way
        # for all: `rank == 0` was False on rank 0 too); comparisons all ranks agree on hold
        rank = comm.get_rank()
        assert rank >= 0 and rank < 4 and rank != 7
        for branch in (lambda: rank == 0, lambda: rank > 1, lambda: not rank):
            with pytest.raises(ValueError, match=r"differs between the ranks .*rank_value"):
                branch()
        assert_matches_single_device(torch.arange(8.0).narrow(0, rank * 2, 2),
                                     lambda r: torch.arange(8.0)[2 * r : 2 * r + 2])  # fmt: skip
        # torch's own comparisons inside an op keep its rule (slicing compares start with 0)
        assert_matches_single_device(torch.arange(8.0)[rank:], lambda r: torch.arange(8.0)[r:])
        # the rank with a tensor every rank shares (torch.tensor makes one even here): each
        # rank's value (it ran once, with a placeholder of 7777777 for the rank on every rank)
        assert_matches_single_device(torch.tensor(0.5) + rank, lambda r: torch.tensor(0.5 + r))
        assert_matches_single_device(
            torch.tensor([1, 2]) * rank, lambda r: torch.tensor([r, 2 * r])
        )
        # one Python number cannot hold every rank's value (AttributeErrors before)
        for convert in (lambda: int(rank), lambda: float(rank), lambda: torch.tensor(rank)):
            with pytest.raises(ValueError, match=r"converted to one Python number .*rank_value"):
                convert()
        shared = torch.tensor(0.0)
        with pytest.raises(ValueError, match="every rank shares"):
            shared += rank
        # one value for a file written for every rank: only where all ranks agree
        assert comm.shared_value(blocks["w"]) is None
        nan = comm.rank_value(lambda r: torch.tensor([float("nan"), 1.0]))
        common = comm.shared_value(nan)
        assert common is not None and type(common) is torch.Tensor
        assert torch.equal(common.isnan(), torch.tensor([True, False]))
        late = comm.rank_value(lambda r: torch.tensor([float("nan"), float(r > 2)]))
        assert comm.shared_value(late) is None
        # a mesh axis: every rank's group is rank 0's shifted, rank 0's stands for them all
        assert comm.own_group(lambda r: (r % 2, r % 2 + 2)) == (0, 2)
        assert comm.own_group(lambda r: (r // 2 * 2 + 1, r // 2 * 2)) == (1, 0)
        with pytest.raises(ValueError, match=r"rank 2's group \[3, 2\] is not rank 0's"):
            comm.own_group(lambda r: (0, 1) if r < 2 else (3, 2))


def test_rank_value_refuses_structures_that_differ_between_ranks() -> None:
    """One joined value holds per-rank ints and tensors, not per-rank list lengths or dict keys:
    rank 1's longer list or extra key was dropped silently (rank 1 got rank 0's ``[0]``), and a
    longer one on rank 0 raised a bare IndexError / KeyError. Each names the ranks now."""
    with simulated_world(2):
        cases = {
            "a list of length 1 and rank 1 a list of length 2": lambda r: list(range(r + 1)),
            "a list of length 2 and rank 1 a list of length 1": lambda r: [0, 1][: 2 - r],
            "a dict of keys ['a'] and rank 1 a dict of keys ['a', 'b']": (
                lambda r: {"a": 1} if r == 0 else {"a": 1, "b": 2}
            ),
            "a dict of keys ['a', 'b'] and rank 1 a dict of keys ['a']": (
                lambda r: {"a": 1, "b": 2} if r == 0 else {"a": 1}
            ),
            "a tensor and rank 1 an int": lambda r: torch.ones(1) if r == 0 else 1,
            "a tuple of length 1 and rank 1 a list of length 1": (
                lambda r: (1,) if r == 0 else [1]
            ),
        }
        for said, make in cases.items():
            with pytest.raises(ValueError, match=r"rank_value: rank 0 gives " + re.escape(said)):
                comm.rank_value(make)
        with pytest.raises(ValueError, match=r"rank_value\['send'\]: .* list of length 0.*pad"):
            comm.rank_value(lambda r: {"send": [1] if r == 0 else []})  # (a one-way send)
        # keys in another order are the same keys: rank 0's order
        joined = comm.rank_value(lambda r: {"a": r, "b": 1} if r == 0 else {"b": 1, "a": r})
        assert list(joined) == ["a", "b"] and joined["b"] == 1
        assert comm.rank_value(lambda r: [r, [r, 2]])[1][1] == 2
