"""Every plan-time error (issue 4, item 8): a ValueError naming the primitive's module path, the
input, the dim, the axis and what would be valid."""

from __future__ import annotations

import ast
import re
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.layout import LayoutTypeError
from shardwise.ops import (
    Add,
    BatchMatMul,
    BiasAdd,
    Flatten,
    Gather,
    LayerNorm,
    LogSoftmax,
    MatMul,
    Primitive,
    ReLU,
    Reshape,
    Softmax,
    SoftmaxCrossEntropyWithLogits,
    name_primitives,
    plan_primitive,
)

LAYOUT = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))
X, W = (32, 784), (784, 512)


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


def test_split_does_not_divide_the_dim() -> None:
    msg = fails(MatMul().shard(((2, 4), (4, 1))), (33, 784), W)
    has(
        msg,
        "input 0 (x): dim 0 of size 33 cannot be split into 2 parts (axes d0)",
        "use a split that divides 33",
    )
    msg = fails(
        MatMul().shard((LAYOUT("mp", ("sp", "dp")), LAYOUT(("sp", "dp"), "None"))),
        (32, 786),
        (786, 512),
    )
    has(msg, "dim 1 of size 786 cannot be split into 4 parts (axes sp*dp)")


def test_default_strategy_that_does_not_divide_the_batch() -> None:
    msg = fails(MatMul(), (4, 512), (512, 10))
    has(
        msg,
        "(default data-parallel strategy ((8, 1), (1, 1)))",
        "dim 0 of size 4 cannot be split into 8 parts",
    )


@pytest.mark.parametrize(("strategy", "used"), [(((2, 3), (3, 1)), 6), (((4, 4), (4, 1)), 16)])
def test_product_must_divide_the_device_count(strategy: Any, used: int) -> None:
    msg = fails(MatMul().shard(strategy), X, W)
    has(
        msg,
        f"uses {used} devices",
        "does not divide the device count 8",
        "must be one of [1, 2, 4, 8]",
    )


@pytest.mark.parametrize("n", [0, -2])
def test_device_num_below_one(n: int) -> None:
    """It said 'the product must be one of [] (below 0, the rest become replicas)'."""
    msg = fails(MatMul().shard(((1, 1), (1, 1))), X, W, n=n)
    has(msg, f"plan_primitive's device_num={n} must be >= 1")
    assert "one of []" not in msg, msg


def test_device_num_not_an_int() -> None:
    with pytest.raises(TypeError, match=r"device_num='8' must be an int >= 1"):
        plan_primitive(MatMul(), X, W, device_num="8")  # type: ignore[arg-type]


def test_layout_matrix_must_hold_every_device() -> None:
    small = sw.Layout((4,), ("tp",))
    msg = fails(MatMul().shard((small("None", "tp"), small("tp", "None"))), X, W)
    has(msg, "DeviceMatrix(tp=4) holds 4 devices but the job has 8")


def test_layouts_on_different_matrices() -> None:
    other = sw.Layout((8,), ("tp",))
    msg = fails(MatMul().shard((LAYOUT("dp", "mp"), other("tp", "None"))), X, W)
    has(msg, "input 1 (w) is laid out on DeviceMatrix(tp=8)", "need the same Layout")


def test_wrong_number_of_entries() -> None:
    msg = fails(MatMul().shard(((2, 4),)), X, W)
    has(msg, "has 1 entry but MatMul has 2 inputs (x, w); give one entry per input")


def test_wrong_number_of_values() -> None:
    msg = fails(MatMul().shard(((2, 4, 1), (4, 1))), X, W)
    has(msg, "input 0 (x) has 2 dims but its strategy (2, 4, 1) has 3 values")
    msg = fails(ReLU().shard((LAYOUT("dp", "mp", "sp"),)), (32, 16))
    has(
        msg, "input 0 (x) has 2 dims (shape [32, 16]) but its layout layout('dp', 'mp', 'sp') has 3"
    )


def test_values_below_one() -> None:
    with pytest.raises(ValueError, match=r"ReLU: in_strategy entry 0 \(0, 1\) splits dim 0"):
        ReLU().shard(((0, 1),))
    relu = ReLU()
    relu.in_strategy = ((0, 1),)  # (set around shard(): the plan's own check)
    has(fails(relu, (32, 16)), "every value must be >= 1")


def test_unknown_and_repeated_aliases_fail_at_the_layout_call() -> None:
    with pytest.raises(ValueError, match=r"unknown alias 'tp'; this layout's aliases are"):
        LAYOUT("tp", "None")
    with pytest.raises(ValueError, match="alias 'dp' is used by dims 0 and 1"):
        LAYOUT("dp", "dp")
    with pytest.raises(ValueError, match=r"repeats \['dp'\]"):
        sw.Layout((2, 4), ("dp", "dp"))


def test_int_and_layout_mixing() -> None:
    with pytest.raises(ValueError, match="mixes int tuples and Layouts"):
        MatMul().shard(((2, 4), LAYOUT("mp", "None")))
    op = MatMul()
    op.in_strategy = ((2, 4), LAYOUT("mp", "None"))  # set behind shard()'s back
    has(fails(op, X, W), "mixes int tuples and Layouts")
    with pytest.raises(LayoutTypeError):  # a TypeError that is also a ValueError
        MatMul().shard(("dp", "mp"))


@pytest.mark.parametrize("op", [Softmax(), LogSoftmax()])
def test_split_softmax_axis(op: Primitive) -> None:
    msg = fails(op.shard(((2, 4),)), (32, 16))
    has(
        msg,
        f"input 0 (x) dim 1 is the {op.name} axis (axis=-1) and cannot be split",
        "splits it into 4",
        "valid: ((8, 1),)",  # (the split moved onto the rows)
    )


def test_split_softmax_axis_with_a_layout() -> None:
    msg = fails(Softmax(0).shard((LAYOUT(("dp", "sp"), "mp"),)), (32, 16))
    has(
        msg,
        "dim 0 is the Softmax axis (axis=0)",
        "splits it into 4 (axes dp, sp)",
        "'None' for that dim",
    )


def test_a_split_shared_by_several_inputs_is_suggested_for_all_of_them() -> None:
    """BatchNorm's channel dim is on one axis in its 5 inputs: each suggestion splits it alike in
    all of them (the second suggestion left the other inputs as they were)."""
    strategy = ((1, 4, 1, 1), (4,), (4,), (2,), (4,))
    msg = fails(sw.ops.BatchNorm().shard(strategy), (8, 16, 4, 4), *[(16,)] * 4)
    has(
        msg,
        "must be split alike",
        "valid: ((1, 4, 1, 1), (4,), (4,), (4,), (4,)) or ((1, 2, 1, 1), (2,), (2,), (2,), (2,))",
    )


def test_matmul_contracted_dims_split_differently() -> None:
    msg = fails(MatMul().shard(((2, 4), (2, 1))), X, W)
    has(
        msg,
        "input 0 (x) dim 1 and input 1 (w) dim 0 (the contracted dim K) must be split alike",
        "into 4 and 2",
        "valid: ((2, 4), (4, 1)) or ((2, 2), (2, 1))",  # (either way round: one fits fewer devices)
    )
    msg = fails(MatMul().shard((LAYOUT("dp", "mp"), LAYOUT("sp", "None"))), X, W)
    has(msg, "(the contracted dim K)", "2 (axes mp) and 2 (axes sp)")


def test_a_suggested_split_divides_the_dims() -> None:
    """K of size 4 split 1 and 8 ways: the suggestion listed ((1, 8), (8, 1)), which cannot
    split K (a probe found the fix refused in turn); only splits dividing every dim on the
    axis are suggested."""
    msg = fails(MatMul().shard(((1, 1), (8, 1))), (8, 4), (4, 16))
    has(msg, "(the contracted dim K) must be split alike", "valid: ((1, 1), (1, 1))")
    assert "(1, 8)" not in msg.split("valid:")[1]


def test_a_suggested_split_fits_the_device_count() -> None:
    """K split 4 and 1 ways on 8 devices: the suggestion ((2, 4), (4, 4)) uses 32 devices and
    was refused in turn (a probe); only suggestions whose device matrix divides the device
    count are listed, and where none does the message says what a fix needs instead."""
    msg = fails(MatMul(transpose_b=True).shard(((2, 4), (4, 1))), (16, 16), (8, 16))
    has(msg, "(the contracted dim K) must be split alike", "valid: ((2, 1), (4, 1))")
    assert "(4, 4)" not in msg.split("valid:")[1], msg
    msg = fails(MatMul().shard(((2, 4), (2, 4))), (16, 16), (16, 8))
    has(
        msg,
        "into 4 and 2",
        "valid: the same split on both, with the strategy's device matrix dividing the device "
        "count 8",
    )


def test_batch_matmul_batch_dims_split_differently() -> None:
    msg = fails(BatchMatMul().shard(((2, 1, 1), (4, 1, 1))), (8, 4, 4), (8, 4, 4))
    has(msg, "input 0 (x) dim 0 and input 1 (y) dim 0 (batch dim 0) must be split alike")


def test_device_axis_reused_across_inputs() -> None:
    msg = fails(MatMul().shard((LAYOUT("dp", "mp"), LAYOUT("mp", "dp"))), X, W)
    has(
        msg,
        "device axis 'dp' splits both input 0 (x) dim 0 (the row dim M) and input 1 (w) "
        "dim 1 (the column dim N)",
    )


def test_a_device_axis_of_size_one_may_be_used_twice() -> None:
    """An axis of size 1 splits nothing: the check lets it take two dims, but the output layout
    took it twice and raised a bare ValueError naming no op; it is kept on one dim."""
    ones = sw.Layout((1, 4, 2), ("dp", "sp", "mp"))
    op = plan_primitive(MatMul().shard((ones("dp", "mp"), ones("mp", "dp"))), X, W, device_num=8)
    assert [o.dims for o in op.outputs] == [((0,), ())]


def test_layer_norm_normalized_dims_split() -> None:
    msg = fails(LayerNorm().shard(((2, 4), (4,), (4,))), (32, 16), (16,), (16,))
    has(
        msg,
        "input 0 (input_x) dim 1 is normalized by LayerNorm (begin_norm_axis=1)",
        "valid: ((8, 1), (1,), (1,))",
    )


def test_layer_norm_gamma_not_split_like_input() -> None:
    op = LayerNorm(2, 1).shard(((2, 4, 1), (2, 1), (4, 1)))
    msg = fails(op, (8, 8, 16), (8, 16), (8, 16))
    has(
        msg,
        "input 0 (input_x) dim 1 and input 1 (gamma) dim 0 must be split alike",
        "valid: ((2, 4, 1), (4, 1), (4, 1))",
    )


def test_reshape_of_an_inner_merged_dim() -> None:
    msg = fails(Reshape().shard(((2, 1, 4),)), (8, 16, 64), shape=(8, 1024))
    has(
        msg,
        "input 0 (x) dim 2 is reshaped together with input dim 1 into output dim(s) [1]",
        "only the outermost input dim of such a run may be split",
        "valid: ((8, 1, 1),)",
    )


def test_flatten_of_an_inner_dim() -> None:
    msg = fails(Flatten().shard(((4, 1, 1, 2),)), (32, 1, 28, 28))
    has(msg, "input 0 (x) dim 3 is reshaped together with input dim 2 into output dim(s) [1]")


def test_reshape_split_that_does_not_divide_the_new_outer_dim() -> None:
    msg = fails(Reshape().shard(((8, 1),)), (32, 64), shape=(4, 8, 64))
    has(msg, "output 0: dim 0 of size 4 cannot be split into 8 parts (axes d0)")


def test_broadcast_dim_split() -> None:
    msg = fails(Add().shard(((8, 1), (8, 1))), (32, 16), (1, 16))
    has(
        msg,
        "input 1 (y) dim 0 (size 1) is broadcast and cannot be split",
        "valid: ((8, 1), (1, 1))",
    )


def test_elementwise_inputs_split_differently() -> None:
    msg = fails(Add().shard(((8, 1), (4, 1))), (32, 16), (32, 16))
    has(msg, "input 0 (x) dim 0 and input 1 (y) dim 0 must be split alike", "into 8 and 4")


def test_bias_not_split_like_the_channel() -> None:
    msg = fails(BiasAdd().shard(((2, 4), (2,))), (32, 16), (16,))
    has(msg, "(the channel dim) must be split alike", "valid: ((2, 4), (4,))")


def test_softmax_cross_entropy_class_dim() -> None:
    op = SoftmaxCrossEntropyWithLogits().shard(((2, 4), (2, 4)))
    has(fails(op, (32, 16), (32, 16)), "input 0 (logits) dim 1 is the class dim")


def test_gather_params_and_indices_split_together() -> None:
    # ((4, 1), (2, 1)) (indices dim 0 only: MindSpore's split batch) is valid; other dims not
    msg = fails(Gather().shard(((4, 1), (1, 2))), (64, 16), (8, 4), axis=0)
    has(msg, "input 1 (input_indices) cannot be split too", "its dim 1 is split into 2")
    msg = fails(Gather().shard(((2, 2), (2, 1))), (64, 16), (8, 4), axis=0)
    has(msg, "input 1 (input_indices) cannot be split too", "its dim 0 is split into 2")


def test_gather_axis_split_needs_params_of_at_most_two_dims() -> None:
    msg = fails(Gather().shard(((8, 1, 1), (1,))), (64, 4, 4), (8,), axis=0)
    has(msg, "needs params of 1 or 2 dims")


def test_gather_batch_dims_forbid_an_axis_split() -> None:
    msg = fails(Gather(1).shard(((1, 8, 1), (1, 1))), (4, 64, 8), (4, 3), axis=1)
    has(msg, "input 0 (input_params) dim 1 is the gathered axis 1 (batch_dims=1)")


def test_gather_needs_its_axis() -> None:
    has(fails(Gather(), (64, 16), (8, 4)), "planning needs the call argument 'axis'")


def test_out_strategy_not_following_from_the_input() -> None:
    msg = fails(MatMul().shard(((2, 4), (4, 1)), ((2, 4),)), X, W)
    has(
        msg,
        "out_strategy ((2, 4),) does not follow from the input strategy",
        "valid: ((2, 1),) or ((8, 1),)",
    )
    layout = sw.Layout((2, 4), ("dp", "mp"))
    op = MatMul().shard((layout("dp", "mp"), layout("mp", "None")), (layout("mp", "None"),))
    has(fails(op, X, W), "valid: (layout('dp', 'None'),) or (layout(('dp', 'mp'), 'None'),)")


def suggested(message: str) -> list[Any]:
    """The strategies a message lists after ``valid:`` (up to a parenthesized note)."""
    listed = message.split("valid: ")[1].split(" (not ")[0]
    return [ast.literal_eval(s) for s in listed.split(" or ")]


TOO_FINE_SCATTER = [  # M (batch, indices rows) of 4 cannot take a ReduceScatter's 8-way split
    (MatMul().shard(((2, 4), (4, 1)), ((2, 4),)), [(4, 16), (16, 8)], {}, ((2, 1),)),
    (BatchMatMul().shard(((2, 1, 4), (2, 4, 1)), ((2, 4, 1),)), [(4, 8, 8)] * 2, {}, ((2, 1, 1),)),
    (Gather().shard(((8, 1), (1, 1)), ((2, 1, 1),)), [(16, 8), (4, 2)], {"axis": 0}, ((1, 1, 1),)),
]


@pytest.mark.parametrize(("op", "shapes", "call", "want"), TOO_FINE_SCATTER)
def test_out_strategy_suggestions_divide_the_output(
    op: Any, shapes: Any, call: Any, want: Any
) -> None:
    """The refused value listed ``((8, 1),)`` as valid, which was refused in turn (dim 0 of
    size 4 split 8 ways); now only values whose splits divide the output are listed, and
    asking for the too fine one says why and what is valid."""
    msg = fails(op, *shapes, **call)
    has(msg, "does not follow from the input strategy", "would split output 0 dim 0 of size 4")
    valid = suggested(msg)
    assert valid == [want], msg
    for value in valid:
        plan_primitive(op.shard(op.in_strategy, value), *shapes, device_num=8, **call)
    too_fine = ((8,) + (1,) * (len(valid[0][0]) - 1),)
    msg = fails(op.shard(op.in_strategy, too_fine), *shapes, **call)
    has(msg, "cannot hold output 0", "it would split dim 0 of size 4 into 8 parts", "valid: ")
    assert suggested(msg) == valid, msg


def test_every_dim_split_differently_is_repaired_in_the_suggestions() -> None:
    """Add ((2, 4), (4, 2)): both dims differ; the fix search repaired dim 0 only, found no fix
    and listed none. Now every such dim is named and each listed fix plans."""
    msg = fails(Add().shard(((2, 4), (4, 2))), (8, 8), (8, 8))
    has(msg, "dim 0 must be split alike", "input 0 (x) dim 1 and input 1 (y) dim 1 into 4 and 2")
    valid = suggested(msg)
    assert valid == [((2, 4), (2, 4)), ((2, 2), (2, 2)), ((4, 2), (4, 2))], msg
    for strategy in valid:
        plan_primitive(Add().shard(strategy), (8, 8), (8, 8), device_num=8)
    msg = fails(Add().shard(((2, 4), (4, 2))), (8, 8), (8, 1))  # (y dim 1 broadcast, yet split)
    has(msg, "input 1 (y) dim 1 (size 1) is broadcast but split", "valid: ((2, 4), (2, 1))")
    plan_primitive(Add().shard(((2, 4), (2, 1))), (8, 8), (8, 1), device_num=8)


def test_out_strategy_on_an_op_without_one() -> None:
    msg = fails(ReLU().shard(((8, 1),), ((8, 1),)), (32, 16))
    has(msg, "the output layout of ReLU cannot be configured", "drop out_strategy")


def test_every_error_is_a_value_error_with_the_dim() -> None:
    msg = fails(MatMul().shard(((2, 4), (2, 1))), X, W)
    assert re.search(r"input \d \(\w+\) dim \d", msg)
