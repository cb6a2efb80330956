"""Every rule family on 8 devices (plans checked, then executed rank by rank), the registry
table, and a Megatron-style GPT block."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import ops
from shardwise.layout import TensorLayout
from shardwise.ops import (
    FAMILIES,
    RULES,
    Add,
    BatchMatMul,
    BiasAdd,
    Comm,
    Dropout,
    Flatten,
    Gather,
    GeLU,
    LayerNorm,
    MatMul,
    Mul,
    OpPlan,
    Primitive,
    ReduceMean,
    ReduceSum,
    Reshape,
    Softmax,
    SoftmaxCrossEntropyWithLogits,
    Transpose,
    plan_primitive,
)

Sim = Callable[..., None]


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64)


def dims(layout: TensorLayout) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(layout.matrix.names[a] for a in axes) for axes in layout.dims)


def check(
    simulate: Sim, op: Primitive, inputs: list[torch.Tensor], n: int = 8, **call: Any
) -> OpPlan:
    plan = plan_primitive(op, *[tuple(x.shape) for x in inputs], device_num=n, **call)
    simulate(op, plan, inputs, call)
    return plan


def test_registry_covers_every_primitive_once() -> None:
    classes = {
        name
        for name, obj in vars(ops).items()
        if inspect.isclass(obj) and issubclass(obj, Primitive) and obj is not Primitive
    }
    assert set(RULES) == classes
    assert sum(len(names) for _, names in FAMILIES.values()) == len(RULES)
    assert RULES["Add"] is RULES["Div"] and RULES["ReLU"] is RULES["Tanh"] is RULES["Dropout"]
    assert RULES["MatMul"] is RULES["BatchMatMul"] and RULES["Reshape"] is RULES["Flatten"]


def test_broadcast_add_bias_row(simulate: Sim) -> None:
    plan = check(simulate, Add().shard(((8, 1), (1,))), [rand(32, 16), rand(16)])
    assert plan.device_matrix == (8, 1) and plan.comms == ()
    assert plan.grad_reduce_axes(1) == ("d0",)


def test_broadcast_size_one_dim_and_layouts(simulate: Sim) -> None:
    check(simulate, Mul().shard(((2, 4), (1, 4))), [rand(8, 16), rand(1, 16)])
    layout = sw.Layout((2, 4), ("dp", "mp"))
    plan = check(
        simulate, Add().shard((layout("dp", "mp"), layout("dp", "mp"))), [rand(8, 16), rand(8, 16)]
    )
    assert dims(plan.outputs[0]) == (("dp",), ("mp",))


SCALAR_LAYOUT = sw.Layout((2, 4), ("dp", "mp"))


@pytest.mark.parametrize("scalar", ["()", "layout()", "left out"])
def test_a_scalar_entry_next_to_layouts(simulate: Sim, scalar: str) -> None:
    # a scalar's entry is (), which may be left out; () next to a Layout call was refused as
    # mixing int tuples and Layouts
    x = SCALAR_LAYOUT("dp", "mp")
    entry = {"()": (), "layout()": SCALAR_LAYOUT(), "left out": None}[scalar]
    add = Add().shard((x,) if entry is None else (x, entry))
    plan = check(simulate, add, [rand(8, 8), rand()])
    assert plan.inputs == (x, SCALAR_LAYOUT()) and plan.outputs == (x,) and plan.comms == ()


def test_an_int_tuple_next_to_layouts_is_still_refused() -> None:
    with pytest.raises(ValueError, match=r"mixes int tuples and Layouts; use one kind for all"):
        Add().shard((SCALAR_LAYOUT("dp", "mp"), (2, 4)))


def test_bias_add_channel_split(simulate: Sim) -> None:
    plan = check(simulate, BiasAdd().shard(((2, 4), (4,))), [rand(8, 16), rand(16)])
    assert plan.grad_reduce_axes(1) == ("d0",)
    check(simulate, BiasAdd().shard(((2, 4, 1, 1), (4,))), [rand(4, 8, 3, 3), rand(8)])
    check(simulate, BiasAdd("NHWC").shard(((2, 1, 1, 4), (4,))), [rand(4, 3, 3, 8), rand(8)])


def test_layer_norm_batch_split(simulate: Sim) -> None:
    op = LayerNorm(2, 2).shard(((2, 4, 1), (1,), (1,)))
    plan = check(simulate, op, [rand(4, 8, 16), rand(16), rand(16)])
    assert plan.output_shapes == ((4, 8, 16), (4, 8, 1), (4, 8, 1)) and plan.comms == ()
    assert [dims(t) for t in plan.outputs[1:]] == [(("d0",), ("d1",), ())] * 2
    assert plan.grad_reduce_axes(1) == plan.grad_reduce_axes(2) == ("d0", "d1")


def test_layer_norm_params_may_split_before_the_norm_axis(simulate: Sim) -> None:
    op = LayerNorm(2, 1).shard(((2, 4, 1), (4, 1), (4, 1)))
    plan = check(simulate, op, [rand(4, 8, 16), rand(8, 16), rand(8, 16)])
    assert dims(plan.inputs[1]) == (("d1",), ())


@pytest.mark.parametrize("keep", [False, True])
def test_reduce_sum_over_a_split_axis_allreduces(simulate: Sim, keep: bool) -> None:
    plan = check(simulate, ReduceSum(keep).shard(((2, 4),)), [rand(8, 16)], axis=1)
    assert plan.comms == (Comm("AllReduce", ("d1",)),)
    assert plan.output_shapes == (((8, 1),) if keep else ((8,),))


def test_reduce_mean_all_dims_and_unsplit_axis(simulate: Sim) -> None:
    plan = check(simulate, ReduceMean().shard(((2, 4),)), [rand(8, 16)])
    assert plan.comms == (Comm("AllReduce", ("d0", "d1"), op="mean"),)
    assert plan.output_shapes == ((),)
    plan = check(simulate, ReduceSum().shard(((8, 1),)), [rand(8, 16)], axis=-1)
    assert plan.comms == ()
    assert str(check(simulate, ReduceMean(), [rand(16, 4)], axis=0).comms[0]) == (
        "AllReduce(mean) over d0"
    )


def test_softmax_any_dim_but_the_axis(simulate: Sim) -> None:
    check(simulate, Softmax().shard(((2, 4, 1),)), [rand(4, 8, 6)])
    check(simulate, Softmax((1, 2)).shard(((8, 1, 1),)), [rand(8, 4, 6)])


def test_softmax_cross_entropy(simulate: Sim) -> None:
    op = SoftmaxCrossEntropyWithLogits().shard(((8, 1), (8, 1)))
    plan = check(simulate, op, [rand(16, 10), rand(16, 10).softmax(-1)])
    assert [dims(t) for t in plan.outputs] == [(("d0",),), (("d0",), ())]


def test_dropout_outputs_share_the_layout_and_need_global_masks() -> None:
    plan = plan_primitive(Dropout().shard(((2, 4),)), (8, 16), device_num=8)
    assert plan.local == "random" and plan.outputs[0] == plan.outputs[1]


def test_gather_vocab_split_is_a_masked_lookup(simulate: Sim) -> None:
    ids = torch.randint(0, 64, (4, 6))
    plan = check(simulate, Gather().shard(((8, 1), (1, 1))), [rand(64, 16), ids], axis=0)
    assert plan.local == "masked_lookup" and plan.comms == (Comm("AllReduce", ("d0",)),)
    assert plan.grad_reduce_axes(0) == ()


def test_gather_vocab_split_with_a_split_batch(simulate: Sim) -> None:
    """MindSpore's ((mp, 1), (dp, 1)): the batch split outer (like the data-parallel ops
    around it), the rows inside each batch group; the AllReduce over the rows' axis only."""
    ids = torch.randint(0, 64, (4, 6))
    plan = check(simulate, Gather().shard(((4, 1), (2, 1))), [rand(64, 16), ids], axis=0)
    assert plan.device_matrix == (2, 1, 4, 1) and plan.local == "masked_lookup"
    assert plan.comms == (Comm("AllReduce", ("d2",)),)
    assert dims(plan.outputs[0]) == (("d0",), (), ())
    assert plan.grad_reduce_axes(0) == ("d0",)  # the table: replicated over the batch axis
    op = Gather().shard(((2, 1), (2, 1)), ((4, 1, 1),))  # 4 of 8 devices, a ReduceScatter
    plan = check(simulate, op, [rand(64, 16), torch.randint(0, 64, (8, 6))], axis=0)
    assert plan.device_matrix == (2, 1, 2, 1, 2)
    assert plan.comms == (Comm("ReduceScatter", ("d2",), dim=0),)


def test_gather_column_split_and_default(simulate: Sim) -> None:
    ids = torch.randint(0, 64, (8, 6))
    plan = check(simulate, Gather().shard(((1, 8), (1, 1))), [rand(64, 16), ids], axis=0)
    assert plan.comms == () and plan.local == "" and dims(plan.outputs[0]) == ((), (), ("d1",))
    plan = check(simulate, Gather(), [rand(64, 16), ids], axis=0)  # indices' batch split
    assert dims(plan.outputs[0])[0] == ("d2",) and plan.grad_reduce_axes(0) == ("d2",)


def test_gather_vocab_split_with_reduce_scatter(simulate: Sim) -> None:
    op = Gather().shard(((8, 1), (1, 1)), ((8, 1, 1),))
    plan = check(simulate, op, [rand(64, 16), torch.randint(0, 64, (8, 6))], axis=0)
    assert plan.comms == (Comm("ReduceScatter", ("d0",), dim=0),)


def test_gather_axis_one_and_batch_dims(simulate: Sim) -> None:
    ids = torch.randint(0, 16, (3,))
    check(simulate, Gather().shard(((4, 2), (1,))), [rand(8, 16), ids], axis=1)
    params, idx = rand(4, 10, 6), torch.randint(0, 10, (4, 5))
    plan = check(simulate, Gather(1).shard(((4, 1, 2), (4, 1))), [params, idx], axis=1)
    assert plan.output_shapes == ((4, 5, 6),) and plan.comms == ()


def test_transpose_moves_the_split(simulate: Sim) -> None:
    plan = check(simulate, Transpose().shard(((2, 4, 1),)), [rand(4, 8, 3)], perm=(1, 0, 2))
    assert dims(plan.outputs[0]) == (("d1",), ("d0",), ())


def test_reshape_split_and_merge(simulate: Sim) -> None:
    plan = check(simulate, Reshape().shard(((2, 4),)), [rand(16, 32)], shape=(4, 4, 4, 8))
    assert dims(plan.outputs[0]) == (("d0",), (), ("d1",), ())
    plan = check(simulate, Reshape().shard(((2, 1, 4, 1),)), [rand(4, 4, 4, 8)], shape=(16, -1))
    assert dims(plan.outputs[0]) == (("d0",), ("d2",))
    check(simulate, Reshape().shard(((2, 1),)), [rand(6, 8)], shape=(8, 6))  # one (6, 8) run


def test_flatten_first_flattened_dim(simulate: Sim) -> None:
    plan = check(simulate, Flatten().shard(((4, 2, 1, 1),)), [rand(8, 4, 3, 3)])
    assert dims(plan.outputs[0]) == (("d0",), ("d1",))


def test_batch_matmul_broadcast_weight_and_split_k(simulate: Sim) -> None:
    plan = check(
        simulate, BatchMatMul().shard(((2, 4, 1, 1), (1, 1))), [rand(2, 4, 8, 6), rand(6, 5)]
    )
    assert plan.comms == () and plan.grad_reduce_axes(1) == ("d0", "d1")
    plan = check(
        simulate, BatchMatMul().shard(((2, 1, 4), (2, 4, 1))), [rand(2, 8, 16), rand(2, 16, 4)]
    )
    assert plan.comms == (Comm("AllReduce", ("d2",)),)


@pytest.mark.parametrize(("ta", "tb"), [(True, False), (False, True), (True, True)])
def test_matmul_transposed_strategies(simulate: Sim, ta: bool, tb: bool) -> None:
    x = rand(16, 8) if ta else rand(8, 16)
    w = rand(4, 16) if tb else rand(16, 4)
    sx = (4, 2) if ta else (2, 4)
    sw_ = (1, 4) if tb else (4, 1)
    plan = check(simulate, MatMul(ta, tb).shard((sx, sw_)), [x, w])
    assert plan.device_matrix == (2, 4, 1) and plan.comms == (Comm("AllReduce", ("d1",)),)


# --- a Megatron-style GPT block on 8 devices: dp = 2, mp = 4 ----------------------------------

B, S, H, N, D, V = 4, 8, 32, 4, 8, 64


def gpt_block() -> list[tuple[str, Primitive, list[torch.Tensor], dict[str, Any]]]:
    """(name, primitive, inputs, call args) of every call of a GPT block, with its strategy."""
    dp, mp = 2, 4
    x2, heads = rand(B * S, H), rand(B, N, S, D)
    return [
        (
            "embed",
            Gather().shard(((mp, 1), (1, 1))),
            [rand(V, H), torch.randint(0, V, (B, S))],
            {"axis": 0},
        ),
        (
            "ln1",
            LayerNorm(2, 2).shard(((dp, 1, 1), (1,), (1,))),
            [rand(B, S, H), rand(H), rand(H)],
            {},
        ),
        ("to_2d", Reshape().shard(((dp, 1, 1),)), [rand(B, S, H)], {"shape": (B * S, H)}),
        ("q_proj", MatMul().shard(((dp, 1), (1, mp))), [x2, rand(H, H)], {}),
        ("q_bias", BiasAdd().shard(((dp, mp), (mp,))), [x2, rand(H)], {}),
        ("split_heads", Reshape().shard(((dp, mp),)), [x2], {"shape": (B, S, N, D)}),
        (
            "heads_first",
            Transpose().shard(((dp, 1, mp, 1),)),
            [rand(B, S, N, D)],
            {"perm": (0, 2, 1, 3)},
        ),
        (
            "scores",
            BatchMatMul(transpose_b=True).shard(((dp, mp, 1, 1), (dp, mp, 1, 1))),
            [heads, heads],
            {},
        ),
        ("scale", Mul().shard(((dp, mp, 1, 1), ())), [rand(B, N, S, S), rand()], {}),
        ("softmax", Softmax().shard(((dp, mp, 1, 1),)), [rand(B, N, S, S)], {}),
        (
            "context",
            BatchMatMul().shard(((dp, mp, 1, 1), (dp, mp, 1, 1))),
            [rand(B, N, S, S), heads],
            {},
        ),
        ("heads_back", Transpose().shard(((dp, mp, 1, 1),)), [heads], {"perm": (0, 2, 1, 3)}),
        (
            "merge_heads",
            Reshape().shard(((dp, 1, mp, 1),)),
            [rand(B, S, N, D)],
            {"shape": (B * S, H)},
        ),
        ("out_proj", MatMul().shard(((dp, mp), (mp, 1))), [x2, rand(H, H)], {}),
        ("residual", Add().shard(((dp, 1), (dp, 1))), [x2, x2], {}),
        ("ln2", LayerNorm().shard(((dp, 1), (1,), (1,))), [x2, rand(H), rand(H)], {}),
        ("fc1", MatMul().shard(((dp, 1), (1, mp))), [x2, rand(H, 4 * H)], {}),
        ("gelu", GeLU().shard(((dp, mp),)), [rand(B * S, 4 * H)], {}),
        ("fc2", MatMul().shard(((dp, mp), (mp, 1))), [rand(B * S, 4 * H), rand(4 * H, H)], {}),
        ("logits", MatMul(transpose_b=True).shard(((dp, 1), (1, 1))), [x2, rand(V, H)], {}),
        (
            "xent",
            SoftmaxCrossEntropyWithLogits().shard(((dp, 1), (dp, 1))),
            [rand(B * S, V), rand(B * S, V).softmax(-1)],
            {},
        ),
        ("loss", ReduceMean().shard(((dp,),)), [rand(B * S)], {"axis": 0}),
    ]


def test_gpt_block_megatron_strategies(simulate: Sim) -> None:
    comms = {}
    for name, op, inputs, call in gpt_block():
        plan = check(simulate, op, inputs, **call)
        if plan.comms:
            comms[name] = [(str(c), c.group_size(plan.matrix)) for c in plan.comms]
    assert comms == {
        "embed": [("AllReduce(sum) over d0", 4)],  # vocab-parallel embedding (masked lookup)
        "out_proj": [("AllReduce(sum) over d1", 4)],  # row-parallel
        "fc2": [("AllReduce(sum) over d1", 4)],  # row-parallel
        "loss": [("AllReduce(mean) over d0", 2)],  # the batch mean
    }


def test_gpt_block_heads_stay_split_through_attention() -> None:
    layouts = {}
    for name, op, inputs, call in gpt_block():
        plan = plan_primitive(op, *[tuple(x.shape) for x in inputs], device_num=8, **call)
        layouts[name] = dims(plan.outputs[0])
    assert layouts["q_proj"] == (("d0",), ("d2",))  # column-parallel
    assert layouts["split_heads"] == (("d0",), (), ("d1",), ())
    assert layouts["heads_first"] == (("d0",), ("d2",), (), ())
    assert layouts["scores"] == layouts["softmax"] == (("d0",), ("d1",), (), ())
    assert layouts["merge_heads"] == (("d0",), ("d2",))


def test_gpt_mlp_with_layouts() -> None:
    layout = sw.Layout((2, 4), ("dp", "mp"))
    col = MatMul().shard((layout("dp", "None"), layout("None", "mp")))
    row = MatMul().shard((layout("dp", "mp"), layout("mp", "None")))
    p1 = plan_primitive(col, (32, 16), (16, 64), device_num=8)
    p2 = plan_primitive(row, (32, 64), (64, 16), device_num=8)
    assert p1.comms == () and dims(p1.outputs[0]) == (("dp",), ("mp",))
    assert p2.comms == (Comm("AllReduce", ("mp",)),) and dims(p2.outputs[0]) == (("dp",), ())
