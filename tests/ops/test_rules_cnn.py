"""The rules of ReduceMax, Exp, Log, Cast, Conv2D, BatchNorm, MaxPool and AvgPool (plans
checked, then executed rank by rank with `run_plan`), and their plan-time errors: a ValueError
naming the primitive's module path, the input, the dim, the axis and what would be valid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.layout import TensorLayout
from shardwise.ops import (
    RULES,
    AvgPool,
    BatchNorm,
    Cast,
    Comm,
    Conv2D,
    Exp,
    Log,
    MaxPool,
    Primitive,
    ReduceMax,
    name_primitives,
    plan_primitive,
)

Sim = Callable[..., None]


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64)


def short(layout: TensorLayout) -> str:
    return str(layout).split(" on ")[0]


def fails(op: Primitive, *shapes: tuple[int, ...], n: int = 8, **call: Any) -> str:
    """Plan `op` inside a network (path ``net.op``) and return the ValueError's message."""
    net = torch.nn.Module()
    net.op = op
    name_primitives(net, "net")
    with pytest.raises(ValueError) as info:
        plan_primitive(op, *shapes, device_num=n, **call)
    message = str(info.value)
    assert message.startswith(f"net.op ({op.name})"), message
    return message


def has(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_families() -> None:
    assert RULES["Exp"] is RULES["Log"] is RULES["Cast"] is RULES["ReLU"]
    assert RULES["ReduceMax"] is RULES["ReduceSum"]
    assert RULES["MaxPool"] is RULES["AvgPool"]
    assert "Conv2D" in RULES and "BatchNorm" in RULES


# -- ReduceMax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_reduce_max_split_axis_is_an_all_reduce_max(simulate: Sim, keep: bool) -> None:
    op = ReduceMax(keep_dims=keep).shard(((2, 4),))
    x = rand(8, 16)
    plan = plan_primitive(op, (8, 16), device_num=8, axis=-1)
    assert plan.comms == (Comm("AllReduce", ("d1",), op="max"),)
    assert short(plan.outputs[0]) == ("(d0, None)" if keep else "(d0)")
    assert plan.output_shapes == (((8, 1),) if keep else ((8,),))
    simulate(op, plan, [x], {"axis": -1})


def test_reduce_max_unsplit_axis_is_local(simulate: Sim) -> None:
    op = ReduceMax().shard(((2, 4),))
    plan = plan_primitive(op, (8, 16), device_num=8, axis=0)
    assert plan.comms == (Comm("AllReduce", ("d0",), op="max"),)
    plan = plan_primitive(ReduceMax().shard(((8, 1),)), (8, 16), device_num=8, axis=1)
    assert plan.comms == () and short(plan.outputs[0]) == "(d0)"
    simulate(ReduceMax().shard(((8, 1),)), plan, [rand(8, 16)], {"axis": 1})
    all_dims = plan_primitive(ReduceMax().shard(((2, 4),)), (8, 16), device_num=8)
    assert all_dims.comms == (Comm("AllReduce", ("d0", "d1"), op="max"),)
    assert str(all_dims.comms[0]) == "AllReduce(max) over d0, d1"


def test_reduce_max_split_that_does_not_divide() -> None:
    msg = fails(ReduceMax().shard(((2, 4),)), (8, 10), axis=-1)
    has(msg, "input 0 (x): dim 1 of size 10 cannot be split into 4 parts (axes d1)", "divides 10")


def test_reduce_max_out_strategy_refused() -> None:
    op = ReduceMax().shard(((2, 4),), ((2,),))
    msg = fails(op, (8, 16), axis=-1)
    has(msg, "cannot be configured", "drop out_strategy")


# -- Exp, Log, Cast ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Exp, Log])
def test_exp_log_any_strategy(simulate: Sim, kind: type[Primitive]) -> None:
    x = rand(8, 16).abs() + 0.1
    for strategy in (((8, 1),), ((2, 4),), ((1, 8),)):
        op = kind().shard(strategy)
        plan = plan_primitive(op, (8, 16), device_num=8)
        assert plan.comms == () and plan.outputs[0].dims == plan.inputs[0].dims
        simulate(op, plan, [x])


def test_cast_layout_and_dtype(simulate: Sim) -> None:
    op = Cast().shard(((2, 4),))
    plan = plan_primitive(op, (8, 16), device_num=8, dtype=torch.float32)
    assert plan.comms == () and short(plan.outputs[0]) == "(d0, d1)"
    x = rand(8, 16)
    assert op(x, torch.float32).dtype == torch.float32 and op(x, "float16").dtype == torch.float16
    simulate(Cast().shard(((2, 4),)), plan, [x], {"dtype": torch.float64})
    with pytest.raises(TypeError, match="dtype must be a torch dtype"):
        op(x, "floaty")


def test_exp_split_that_does_not_divide() -> None:
    msg = fails(Exp().shard(((1, 8),)), (8, 12))
    has(msg, "input 0 (x): dim 1 of size 12 cannot be split into 8 parts (axes d1)", "divides 12")
    msg = fails(Cast().shard(((3, 1),)), (10, 4), n=3, dtype=torch.float32)
    has(msg, "input 0 (input_x): dim 0 of size 10 cannot be split into 3 parts (axes d0)")


# -- Conv2D ------------------------------------------------------------------------------------

X, WT = (8, 16, 9, 9), (8, 16, 3, 3)


def test_conv_n_and_c_out_splits_are_local(simulate: Sim) -> None:
    op = Conv2D(8, 3).shard(((2, 1, 1, 1), (4, 1, 1, 1)))
    plan = plan_primitive(op, X, WT, device_num=8)
    assert plan.device_matrix == (2, 1, 1, 1, 4) and plan.comms == ()
    assert short(plan.inputs[1]) == "(d4, None, None, None)"
    assert short(plan.outputs[0]) == "(d0, d4, None, None)"
    assert plan.output_shapes == ((8, 8, 7, 7),)
    assert plan.grad_reduce_axes(1) == ("d0",)
    simulate(op, plan, [rand(*X), rand(*WT)])


def test_conv_c_in_split_is_an_all_reduce(simulate: Sim) -> None:
    op = Conv2D(8, 3, pad_mode="same", stride=2).shard(((2, 4, 1, 1), (1, 4, 1, 1)))
    plan = plan_primitive(op, X, WT, device_num=8)
    assert plan.comms == (Comm("AllReduce", ("d1",)),)
    assert plan.output_shapes == ((8, 8, 5, 5),)
    simulate(op, plan, [rand(*X), rand(*WT)])


def test_conv_default_is_data_parallel(simulate: Sim) -> None:
    op = Conv2D(8, 3, pad_mode="pad", pad=(1, 0, 2, 1), dilation=2)
    plan = plan_primitive(op, X, WT, device_num=8)
    assert not plan.user_set and plan.comms == ()
    assert short(plan.inputs[0]) == "(d0, None, None, None)"
    simulate(op, plan, [rand(*X), rand(*WT)])


def test_conv_spatial_split_refused() -> None:
    msg = fails(Conv2D(8, 3).shard(((1, 1, 2, 1), (1, 1, 1, 1))), X, WT)
    has(
        msg,
        "input 0 (x) dim 2 is the height H of Conv2D",
        "halo exchange",
        "splits it into 2",
        "valid: ((2, 1, 1, 1), (1, 1, 1, 1))",  # (H's split moved onto N)
    )
    msg = fails(Conv2D(8, 3).shard(((2, 1, 1, 4), (1, 1, 1, 1))), X, WT)
    has(msg, "dim 3 is the width W of Conv2D", "valid: ((8, 1, 1, 1), (1, 1, 1, 1))")


def test_conv_kernel_split_refused() -> None:
    msg = fails(Conv2D(8, 3).shard(((1, 1, 1, 1), (2, 1, 1, 3))), X, WT)
    has(
        msg,
        "input 1 (weight) dim 3 is the kernel width kw of Conv2D",
        "splits it into 3",
        "valid: ((1, 1, 1, 1), (2, 1, 1, 1))",
    )


def test_conv_channel_splits_must_agree_and_divide() -> None:
    msg = fails(Conv2D(8, 3).shard(((1, 2, 1, 1), (1, 4, 1, 1))), X, WT)
    has(msg, "input 0 (x) dim 1 and input 1 (weight) dim 1", "must be split alike", "(1, 2, 1, 1)")
    msg = fails(Conv2D(6, 3).shard(((1, 1, 1, 1), (4, 1, 1, 1))), X, (6, 16, 3, 3))
    has(msg, "input 1 (weight): dim 0 of size 6 cannot be split into 4 parts (axes d4)")


def test_conv_grouped_channels_refused_and_shapes_checked() -> None:
    msg = fails(Conv2D(8, 3, group=2).shard(((1, 2, 1, 1), (1, 2, 1, 1))), X, (8, 8, 3, 3))
    has(msg, "input 0 (x) dim 1 is a channel dim of a grouped Conv2D (group=2)")
    msg = fails(Conv2D(8, 3), X, (8, 16, 5, 5))
    has(msg, "weight must have shape [out_channel, C_in / group, kh, kw] = [8, 16, 3, 3]")
    with pytest.raises(ValueError, match="pad_mode"):
        Conv2D(8, 3, pad_mode="reflect")
    with pytest.raises(ValueError, match="data_format"):
        Conv2D(8, 3, data_format="NHWC")


def test_conv_forward_matches_torch() -> None:
    x, w = rand(2, 4, 7, 7), rand(6, 2, 3, 3)
    same = Conv2D(6, 3, pad_mode="same", group=2)(x, w)
    torch.testing.assert_close(same, torch.nn.functional.conv2d(x, w, padding=1, groups=2))
    pad = Conv2D(6, (3, 3), pad_mode="pad", pad=(1, 2, 0, 1), stride=(1, 1, 2, 2))(
        x[:, :1], w[:, :1]
    )
    ref = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x[:, :1], (0, 1, 1, 2)), w[:, :1], stride=2
    )
    torch.testing.assert_close(pad, ref)
    assert Conv2D(6, 3, pad_mode="same", stride=2)(x[:, :2], w).shape == (2, 6, 4, 4)


# -- pooling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [MaxPool, AvgPool])
def test_pool_n_and_c_splits(simulate: Sim, kind: type[Primitive]) -> None:
    x = rand(4, 8, 6, 6)
    for strategy in (((8, 1, 1, 1),), ((2, 4, 1, 1),), ((1, 8, 1, 1),)):
        op = kind(kernel_size=3, strides=2, pad_mode="SAME").shard(strategy)
        plan = plan_primitive(op, (8, 8, 6, 6), device_num=8)
        assert plan.comms == () and plan.output_shapes == ((8, 8, 3, 3),)
        simulate(op, plan, [torch.cat([x, x])])


@pytest.mark.parametrize("kind", [MaxPool, AvgPool])
def test_pool_spatial_split_refused(kind: type[Primitive]) -> None:
    msg = fails(kind(2, 2).shard(((2, 1, 4, 1),)), (8, 8, 8, 8))
    has(
        msg,
        f"input 0 (x) dim 2 is the height H of {kind.__name__}",
        "halo exchange",
        "valid: ((8, 1, 1, 1),)",
    )
    msg = fails(kind(2, 2).shard(((3, 1, 1, 1),)), (8, 8, 8, 8), n=3)
    has(msg, "dim 0 of size 8 cannot be split into 3 parts (axes d0)")


def test_pool_forward() -> None:
    x = rand(1, 1, 3, 3)
    torch.testing.assert_close(MaxPool(2, 2)(x), x[..., :2, :2].amax((-1, -2), keepdim=True))
    same = AvgPool(2, 2, pad_mode="same")(x)  # 2x2 out; the padded cells are not counted
    assert same.shape == (1, 1, 2, 2)
    torch.testing.assert_close(same[0, 0, 1, 1], x[0, 0, 2, 2])
    torch.testing.assert_close(same[0, 0, 0, 1], x[0, 0, :2, 2].mean())
    assert MaxPool((1, 1, 2, 2), (1, 1, 2, 2), "SAME")(-x.abs() - 1).max() < 0  # -inf padding


# -- BatchNorm ---------------------------------------------------------------------------------

C = 8
BN_SHAPES = ((8, C, 4, 4), (C,), (C,), (C,), (C,))


def bn_inputs() -> list[torch.Tensor]:
    return [rand(8, C, 4, 4), rand(C), rand(C), rand(C), rand(C).abs() + 0.5]


def test_batch_norm_inference_any_split(simulate: Sim) -> None:
    for strategy in (
        ((8, 1, 1, 1), (1,), (1,), (1,), (1,)),
        ((2, 4, 1, 1), (4,), (4,), (4,), (4,)),
        ((1, 2, 2, 2), (2,), (2,), (2,), (2,)),
    ):
        op = BatchNorm().shard(strategy)
        plan = plan_primitive(op, *BN_SHAPES, device_num=8)
        assert plan.comms == () and plan.local == ""
        simulate(op, plan, bn_inputs())


def test_batch_norm_training_plan() -> None:
    op = BatchNorm(is_training=True).shard(((2, 4, 1, 1), (4,), (4,), (4,), (4,)))
    plan = plan_primitive(op, *BN_SHAPES, device_num=8)
    assert plan.local == "batch_stats" and plan.comms == ()
    assert plan.device_matrix == (2, 4, 1, 1)
    assert [short(t) for t in plan.outputs] == ["(d0, d1, None, None)"] + ["(d1)"] * 4
    default = plan_primitive(
        BatchNorm(is_training=True), (16, C), (C,), (C,), (C,), (C,), device_num=8
    )
    assert short(default.inputs[0]) == "(d0, None)" and short(default.inputs[1]) == "(None)"


def test_batch_norm_errors() -> None:
    msg = fails(BatchNorm().shard(((1, 4, 1, 1), (2,), (4,), (4,), (4,))), *BN_SHAPES)
    has(msg, "input 0 (input_x) dim 1 and input 1 (scale) dim 0", "must be split alike")
    msg = fails(
        BatchNorm().shard(((1, 8, 1, 1), (8,), (8,), (8,), (8,))),
        (8, 12),
        (12,),
        (12,),
        (12,),
        (12,),
    )
    has(msg, "input 0 (input_x)", "2 dims")
    msg = fails(BatchNorm(), (8, C, 4, 4), (C,), (C,), (C,), (4,))
    has(msg, "variance must have shape [C] = [8], got [4]")


def test_batch_norm_forward_matches_torch() -> None:
    x, scale, bias, mean, var = bn_inputs()
    rm, rv = mean.clone(), var.clone()
    y, bm, bv, r1, r2 = BatchNorm(is_training=True, momentum=0.2)(x, scale, bias, mean, var)
    ref = torch.nn.functional.batch_norm(x, rm, rv, scale, bias, True, 0.2, 1e-5)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(mean, rm)  # running statistics updated in place, as torch
    torch.testing.assert_close(var, rv)
    torch.testing.assert_close(bm, x.mean((0, 2, 3)))
    torch.testing.assert_close(bv, x.var((0, 2, 3), unbiased=False))
    torch.testing.assert_close(r1, bm) and torch.testing.assert_close(r2, bv)
    y2, m2, v2, *_ = BatchNorm()(x, scale, bias, mean, var)
    ref2 = torch.nn.functional.batch_norm(x, mean, var, scale, bias, False, 0.1, 1e-5)
    torch.testing.assert_close(y2, ref2)
    torch.testing.assert_close(m2, mean) and torch.testing.assert_close(v2, var)


def test_layouts_for_the_new_rules() -> None:
    layout = sw.Layout((2, 4), ("dp", "mp"))
    op = Conv2D(8, 3).shard(
        (layout("dp", "mp", "None", "None"), layout("None", "mp", "None", "None"))
    )
    plan = plan_primitive(op, X, WT, device_num=8)
    assert plan.comms == (Comm("AllReduce", ("mp",)),)
    msg = fails(
        Conv2D(8, 3).shard(
            (layout("dp", "None", "None", "None"), layout("None", "None", "mp", "None"))
        ),
        X,
        WT,
    )
    has(msg, "input 1 (weight) dim 2 is the kernel height kh", "'None' for that dim")
    rmax = ReduceMax().shard((layout("dp", "mp"),))
    assert plan_primitive(rmax, (8, 16), device_num=8, axis=1).comms == (
        Comm("AllReduce", ("mp",), op="max"),
    )
