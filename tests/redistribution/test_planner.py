"""The planner on chosen cases: the plans themselves, their printout, the cost model, the pure
`apply_step`, determinism, divisibility and the errors."""

from __future__ import annotations

import pytest

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.redistribution import (
    AllGather,
    AlltoAll,
    Slice,
    apply_step,
    plan_redistribution,
)

from ._layouts import lay

SHAPE = (8, 8, 8)
DP, SP, MP = 0, 1, 2


def test_same_layout_is_empty() -> None:
    plan = plan_redistribution(lay("dp", "sp", None), lay("dp", "sp", None), SHAPE)
    assert plan.steps == () and plan.total_bytes == 0 and plan.collectives(0) == []


def test_replicated_to_split_is_slices_only() -> None:
    plan = plan_redistribution(lay(None, None, None), lay("mp", ("sp", "dp"), None), SHAPE)
    assert plan.steps == (Slice(0, MP), Slice(1, SP), Slice(1, DP))
    assert plan.total_bytes == 0 and plan.collectives(0) == []


def test_split_to_replicated_gathers_innermost_first() -> None:
    plan = plan_redistribution(lay("mp", ("sp", "dp"), None), lay(None, None, None), SHAPE)
    # every order costs the same; ties go to the lower dim; dim 1 loses dp (innermost) first
    assert plan.steps == (AllGather(0, MP), AllGather(1, DP), AllGather(1, SP))
    assert plan.step_bytes == (256, 512, 1024)
    assert plan.total_bytes == 8 * 8 * 8 * 4 - 256  # everything but the 256 B local block
    # (dim 1's two gathers run as one AllGather over sp x dp, as MindSpore gathers a tuple dim)
    assert plan.collectives(0) == [("AllGather", (0, 1)), ("AllGather", (0, 2, 4, 6))]


def test_moving_an_axis_is_one_alltoall() -> None:
    plan = plan_redistribution(lay("dp", None, None), lay(None, "dp", None), SHAPE)
    assert plan.steps == (AlltoAll(DP, 0, 1),)
    assert plan.step_bytes == (512,)  # (k - 1) / k of the 1 KiB block


def test_swap_slices_first_to_shrink_the_alltoalls() -> None:
    # swapping dp and mp (512 B blocks): gather dp + move mp + slice dp sends 1 KiB, three
    # AlltoAlls through the free dim 768 B; slicing by the replicated sp first halves the
    # block, so three AlltoAlls of 128 B and a final 256 B AllGather of sp cost 640 B
    plan = plan_redistribution(lay("dp", "mp", None), lay("mp", "dp", None), SHAPE)
    assert plan.steps == (
        Slice(2, SP),
        AlltoAll(DP, 0, 2),
        AlltoAll(MP, 1, 0),
        AlltoAll(DP, 2, 1),
        AllGather(2, SP),
    )
    assert plan.step_bytes == (0, 128, 128, 128, 256)


def test_printout() -> None:
    plan = plan_redistribution(lay("dp", "sp", "mp"), lay("mp", ("sp", "dp"), None), SHAPE)
    text = str(plan)
    assert text.splitlines()[0] == (
        "(dp, sp, mp) -> (mp, (sp, dp), None) on DeviceMatrix(dp=2, sp=2, mp=2), "
        "shape [8, 8, 8]: 2 step(s), 256 B/rank"
    )
    assert "AlltoAll(dim 0 -> 1, axis=dp, group size 2)" in text
    assert "-> (mp, (sp, dp), None)" in text
    assert len(text.splitlines()) == 1 + len(plan.steps)
    gather = plan_redistribution(lay(None, "dp", None), lay(None, None, None), (8, 32, 8))
    assert "AllGather(dim=1, axis=dp, group size 2)" in str(gather)
    assert "4.0 KiB/rank" in str(gather)
    assert str(Slice(0, 2)) == "Slice(dim=0, axis=2)"


def test_itemsize_scales_costs() -> None:
    src, dst = lay("dp", None, None), lay(None, None, None)
    assert plan_redistribution(src, dst, SHAPE, itemsize=2).total_bytes == 512
    assert plan_redistribution(src, dst, SHAPE, itemsize=8).total_bytes == 2048


def test_deterministic() -> None:
    src, dst = lay(("dp", "sp", "mp"), None, None), lay(("mp", "sp", "dp"), None, None)
    plans = {plan_redistribution(src, dst, SHAPE) for _ in range(3)}
    assert len(plans) == 1


def test_divisibility_is_respected() -> None:
    # dim 1 (size 2) takes only one 2-way axis: dp cannot move there while sp splits it
    src, dst = lay("dp", "sp", None), lay("sp", "dp", None)
    plan = plan_redistribution(src, dst, (8, 2, 8))
    for layout in plan.layouts:
        layout.check((8, 2, 8))
    assert plan.layouts[-1] == dst


def test_axis_of_size_one_costs_nothing() -> None:
    m = DeviceMatrix((2, 1, 4), ("dp", "sp", "mp"))
    src = lay("sp", "mp", None, matrix=m)
    dst = lay("mp", None, ("dp", "sp"), matrix=m)
    plan = plan_redistribution(src, dst, (8, 8, 8))
    assert plan.layouts[-1] == dst
    moves_sp = [s for s in plan.steps if s.axis == 1]
    assert moves_sp and all(
        nbytes == 0 for s, nbytes in zip(plan.steps, plan.step_bytes, strict=True) if s.axis == 1
    )
    # no collective for the 1-rank groups of sp
    assert all(len(group) > 1 for _, group in plan.collectives(0))
    assert len(plan.collectives(0)) == sum(
        1 for s in plan.steps if not isinstance(s, Slice) and s.axis != 1
    )


def test_apply_step() -> None:
    x = lay("mp", ("sp", "dp"), None)
    assert apply_step(x, AllGather(1, DP)) == lay("mp", "sp", None)
    assert apply_step(x, AlltoAll(MP, 0, 2)) == lay(None, ("sp", "dp"), "mp")
    assert apply_step(lay(None, "sp", None), Slice(1, DP)) == lay(None, ("sp", "dp"), None)
    with pytest.raises(ValueError, match="not the innermost axis of dim 1"):
        apply_step(x, AllGather(1, SP))  # an outer axis: its blocks are strided
    with pytest.raises(ValueError, match="not a replicated axis"):
        apply_step(x, Slice(2, MP))
    with pytest.raises(ValueError, match="must differ"):
        apply_step(x, AlltoAll(MP, 0, 0))
    with pytest.raises(ValueError, match="not a dim"):
        apply_step(x, Slice(3, MP))


def test_errors() -> None:
    other = DeviceMatrix((2, 4), ("dp", "mp"))
    with pytest.raises(ValueError, match="same device matrix"):
        plan_redistribution(lay("dp", None, None), TensorLayout(other, ((0,), (), ())), SHAPE)
    with pytest.raises(ValueError, match="dim 0 of size 6 cannot be split into 4 parts"):
        plan_redistribution(lay(None, None, None), lay(("dp", "sp"), None, None), (6, 8, 8))
    with pytest.raises(ValueError, match=r"source: layout .* has 3 dims"):
        plan_redistribution(lay("dp", None, None), lay(None, None, None), (8, 8))
    with pytest.raises(ValueError, match="itemsize"):
        plan_redistribution(lay("dp", None, None), lay(None, None, None), SHAPE, itemsize=0)
