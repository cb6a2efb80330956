"""Bad arguments to the collectives and groups raise a clear ValueError/TypeError naming the
argument, before any communication happens."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

import shardwise as sw
from shardwise.communication import create_group, destroy_group, get_rank
from shardwise.testing import CommRecorder, simulated_world


def test_all_to_all_wrong_split_count() -> None:
    with (
        simulated_world(4),
        pytest.raises(ValueError, match="split_count=2 must equal the group size 4"),
    ):
        sw.ops.AlltoAll(2, 0, 0)(torch.ones(4, 4))


def test_all_to_all_split_dim_not_divisible() -> None:
    with simulated_world(4), pytest.raises(ValueError, match=r"dim 1 \(split_dim\) has size 6"):
        sw.ops.AlltoAll(4, 1, 0)(torch.ones(4, 6))


def test_all_to_all_dim_out_of_range() -> None:
    with simulated_world(2), pytest.raises(ValueError, match="concat_dim=3 is out of range"):
        sw.ops.AlltoAll(2, 0, 3)(torch.ones(4, 6))


@pytest.mark.parametrize("bad", [0, -1])
def test_all_to_all_bad_split_count_at_construction(bad: int) -> None:
    with pytest.raises(ValueError, match="split_count"):
        sw.ops.AlltoAll(bad, 0, 0)


def test_reduce_scatter_dim0_not_divisible() -> None:
    with simulated_world(4), pytest.raises(ValueError, match=r"dim 0 of size 6.*4 ranks"):
        sw.ops.ReduceScatter()(torch.ones(6, 2))


def test_reduce_scatter_scalar() -> None:
    with simulated_world(2), pytest.raises(ValueError, match="0-d tensor"):
        sw.ops.ReduceScatter()(torch.tensor(1.0))


def test_all_gather_scalar() -> None:
    with simulated_world(2), pytest.raises(ValueError, match="at least one dimension"):
        sw.ops.AllGather()(torch.tensor(1.0))


def test_mismatched_shapes_across_ranks() -> None:
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.ones(2 + r, 3))
        with (
            CommRecorder() as rec,
            pytest.raises(ValueError, match="rank 0: \\[2, 3\\], rank 1: \\[3, 3\\]"),
        ):
            sw.ops.AllGather()(x)
        assert rec.count() == 0


def test_unknown_reduce_op() -> None:
    with pytest.raises(ValueError, match="op='avg' is not a reduction"):
        sw.ops.AllReduce("avg")


def test_unknown_group() -> None:
    with simulated_world(2), pytest.raises(ValueError, match="unknown group 'nope'") as e:
        sw.ops.AllReduce(group="nope")(torch.ones(2))
    # (a rank outside a group its members created gets this too: the message says so)
    assert "a rank outside the group cannot call its collectives" in str(e.value)


def test_group_must_be_a_name() -> None:
    with pytest.raises(TypeError, match="group must be a group name"):
        sw.ops.AllReduce(group=3)  # type: ignore[arg-type]


def test_broadcast_root_not_in_group() -> None:
    with simulated_world(4):
        create_group("evens", [0, 2])
        with pytest.raises(ValueError, match="root_rank=1 is not a rank of group evens"):
            sw.ops.Broadcast(1, group="evens")(torch.ones(2))
        with pytest.raises(ValueError, match="root_rank=7 is not a rank"):
            sw.ops.Broadcast(7)(torch.ones(2))
    with pytest.raises(ValueError, match="root_rank=-1"):
        sw.ops.Broadcast(-1)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 4], r"rank_ids \[4\] are outside \[0, 4\)"),
        ([1, 1], "contain duplicates"),
        ([], "non-empty list of ints"),
        ([0, "1"], "non-empty list of ints"),
        ([0, 3, 1], "cannot be simulated"),
    ],
)
def test_create_group_bad_rank_ids(ids: list[int], message: str) -> None:
    with simulated_world(4), pytest.raises(ValueError, match=message):
        create_group("g", ids)


@pytest.mark.parametrize(
    ("n", "ids", "copies"),
    [(4, [1, 2], r"\[0, 1\], \[2, 3\]"), (8, [2, 3, 4, 5], r"\[0, 1, 2, 3\], \[4, 5, 6, 7\]")],
)
def test_create_group_that_is_not_a_copy_tiling_the_world(
    n: int, ids: list[int], copies: str
) -> None:
    """[1, 2] of 4: its translates that tile the world are [0, 1] and [2, 3], not [1, 2]
    itself; it was accepted and its collectives ran on [0, 1] and [2, 3] (an AllReduce of
    ranks 1 and 2 left each rank's own value, an AllGather returned garbage)."""
    with simulated_world(n), pytest.raises(ValueError) as info:
        create_group("mid", ids)
    message = str(info.value)
    assert re.search(rf"create_group\('mid'\): ranks {re.escape(str(ids))} cannot", message)
    assert re.search(rf"tile the {n} ranks are {copies}, and", message)
    assert "own_group" in message and "run_job" in message


def test_create_group_with_per_rank_ids_points_to_own_group() -> None:
    with simulated_world(4), pytest.raises(ValueError, match=r"per-rank ints.*own_group"):
        create_group("tp", sw.communication.rank_value(lambda r: [r // 2 * 2, r // 2 * 2 + 1]))


def test_neighbor_exchange_peer_outside_the_ranks_copy() -> None:
    """In the group [0, 2] (its copy [1, 3] running at once) rank 1 may not name rank 2."""
    with simulated_world(4):
        create_group("pair", [0, 2])
        peer = sw.communication.rank_value(lambda r: 0 if r == 2 else 2)
        op = sw.ops.NeighborExchange([peer], [peer], [[2]], [[2]], group="pair")
        with pytest.raises(
            ValueError, match=r"=2 on rank 1 is not a rank of its group pair\[1, 3\]"
        ):
            op((torch.ones(2),))


def test_create_group_name_taken_and_destroy() -> None:
    with simulated_world(4):
        create_group("g", [0, 1])
        with pytest.raises(ValueError, match="a group named 'g' exists"):
            create_group("g", [0, 1])
        destroy_group("g")
        with pytest.raises(ValueError, match="no group named 'g'"):
            destroy_group("g")
        with pytest.raises(ValueError, match="world group"):
            destroy_group("world_group")


def test_get_rank_in_group() -> None:
    with simulated_world(4) as world:
        create_group("pairs", [0, 1])
        r = get_rank("pairs")
        assert world.values(r) == [0, 1, 0, 1]
        assert world.values(get_rank()) == [0, 1, 2, 3]
        assert sw.communication.get_group_size("pairs") == 2


def test_neighbor_exchange_shape_mismatch_names_both_ranks() -> None:
    with simulated_world(2):
        rank = get_rank()
        op = sw.ops.NeighborExchange([(rank + 1) % 2], [(rank + 1) % 2], [[2, 4]], [[2, 3]])
        with pytest.raises(
            ValueError, match=r"expects shape \[2, 4\] from rank 1 .* sends shape \[2, 3\]"
        ):
            op((torch.ones(2, 3),))


@pytest.mark.parametrize("sent", [torch.float64, torch.int32])
def test_neighbor_exchange_dtype_mismatch_names_both(sent: torch.dtype) -> None:
    """A message of another dtype than recv_type: a ValueError as in a job (the simulated world
    cast it silently)."""
    with simulated_world(2):
        rank = get_rank()
        op = sw.ops.NeighborExchange([(rank + 1) % 2], [(rank + 1) % 2], [[2]], [[2]])
        with pytest.raises(ValueError, match=rf"of torch.float32 from rank .* of {sent}: make"):
            op((torch.ones(2, dtype=sent),))


def test_neighbor_exchange_unmatched_receive() -> None:
    with simulated_world(4):
        rank = get_rank()
        op = sw.ops.NeighborExchange([(rank + 1) % 4], [(rank + 2) % 4], [[2]], [[2]])
        with pytest.raises(ValueError, match="sends nothing to rank"):
            op((torch.ones(2),))


def test_neighbor_exchange_input_shape_vs_send_shapes() -> None:
    with simulated_world(2):
        op = sw.ops.NeighborExchange([1], [1], [[2]], [[3]])
        with pytest.raises(
            ValueError, match=r"input 0 has shape \[2\] but send_shapes\[0\] is \[3\]"
        ):
            op((torch.ones(2),))
        with pytest.raises(ValueError, match="got 2 input tensors"):
            op((torch.ones(3), torch.ones(3)))


def test_neighbor_exchange_peer_outside_group() -> None:
    with simulated_world(2):
        op = sw.ops.NeighborExchange([5], [0], [[2]], [[2]])
        with pytest.raises(ValueError, match=r"send_rank_ids\[0\]=5 is not a rank"):
            op((torch.ones(2),))


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"send_rank_ids": [0] * 7}, ValueError, "send_rank_ids must have 8 entries"),
        ({"send_rank_ids": [1, 1, -1, -1, -1, -1, -1, -1]}, ValueError, "repeats a rank"),
        (
            {"recv_rank_ids": [-2] + [-1] * 7},
            ValueError,
            r"recv_rank_ids\[0\]=-2 must be an int >= -1",
        ),
        ({"send_lens": [1, 1, -1, 1]}, ValueError, r"send_lens\[2\]=-1 must be an int >= 0"),
        ({"recv_lens": (1, 1)}, ValueError, "recv_lens must have 4 entries"),
        ({"data_format": "NHWC"}, ValueError, "only 'NCHW'"),
        ({"send_lens": 3}, TypeError, "send_lens must be a list"),
    ],
)
def test_neighbor_exchange_v2_bad_arguments(
    kwargs: dict[str, object], exc: type[Exception], message: str
) -> None:
    args: dict[str, object] = {
        "send_rank_ids": [-1] * 8,
        "send_lens": [1, 1, 1, 1],
        "recv_rank_ids": [-1] * 8,
        "recv_lens": [1, 1, 1, 1],
    }
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        sw.ops.NeighborExchangeV2(**args)  # type: ignore[arg-type]


def test_neighbor_exchange_v2_input_checks() -> None:
    with simulated_world(2):
        op = sw.ops.NeighborExchangeV2([-1] * 8, [3, 0, 0, 0], [-1] * 8, [0, 0, 0, 0])
        with pytest.raises(ValueError, match="must be 4-D NCHW"):
            op(torch.ones(2, 2, 2))
        with pytest.raises(ValueError, match="exceed the input's H=2"):
            op(torch.ones(1, 1, 2, 2))


def test_simulated_world_refuses_nesting_and_bad_size() -> None:
    with pytest.raises(ValueError, match="world_size=0"), simulated_world(0):
        pass
    with (
        simulated_world(2),
        pytest.raises(RuntimeError, match="already exists"),
        simulated_world(2),
    ):
        pass


def test_reduce_scatter_of_per_rank_shapes_says_so() -> None:
    """Rows that differ between the ranks: the same-shape message, not a dim-0 one showing a
    per-rank size."""
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.ones(r + 2, 3))
        with pytest.raises(ValueError, match="every rank must pass the same input shape"):
            sw.ops.ReduceScatter()(x)


NOT_TENSORS = [
    ("AllReduce", lambda: sw.ops.AllReduce(), 3.0, "input: float"),
    ("AllReduce", lambda: sw.ops.AllReduce(), np.ones(2), "input: ndarray"),
    ("AllGather", lambda: sw.ops.AllGather(), [torch.ones(2)], "input: list"),
    ("ReduceScatter", lambda: sw.ops.ReduceScatter(), 2, "input: int"),
    ("AlltoAll", lambda: sw.ops.AlltoAll(2, 0, 0), (1, 2), "input: tuple"),
    ("Broadcast", lambda: sw.ops.Broadcast(0), (torch.ones(2), 3), "input 1: int"),
    ("Broadcast", lambda: sw.ops.Broadcast(0), 3, "input: int"),
    (
        "NeighborExchange",
        lambda: sw.ops.NeighborExchange([1], [1], [[2]], [[2]]),
        ("a",),
        "input 0: str",
    ),
    (
        "NeighborExchangeV2",
        lambda: sw.ops.NeighborExchangeV2([-1] * 8, [0] * 4, [-1] * 8, [0] * 4),
        None,
        "input: NoneType",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "make", "value", "message"),
    NOT_TENSORS,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(NOT_TENSORS)],
)
def test_a_primitive_called_with_a_non_tensor_names_itself(
    name: str, make: Callable[[], torch.nn.Module], value: object, message: str
) -> None:
    """A TypeError naming the primitive, what it got and what it takes (not an AttributeError
    from deep inside)."""
    takes = (
        "a tensor or a tuple of tensors"
        if name in ("Broadcast", "NeighborExchange")
        else "a tensor"
    )
    what, got = message.split(": ")
    op = make()
    with simulated_world(2), CommRecorder() as rec, pytest.raises(TypeError) as err:
        op(value)
    want = f"{name}: {what} must be a torch.Tensor, got {got}; {name} takes {takes}"
    assert str(err.value).startswith(want)
    assert not rec.records


def test_broadcast_takes_any_iterable_of_tensors() -> None:
    """``Broadcast(0)(net.parameters())``, an ``nn.ParameterList`` or a generator is a tuple of
    tensors, as before the type check: every rank gets rank 0's values."""
    net = torch.nn.Linear(2, 2)
    kept = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(3))])
    with simulated_world(2) as world:
        x = world.rank_map(lambda r: torch.full((2,), float(r + 1)))
        assert len(sw.ops.Broadcast(0)(net.parameters())) == 2
        assert len(sw.ops.Broadcast(0)(kept)) == 1
        (out,) = sw.ops.Broadcast(0)(t for t in [x])
        assert [v.tolist() for v in world.values(out)] == [[1.0, 1.0], [1.0, 1.0]]
