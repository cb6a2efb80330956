"""Seed 003's strategy lines on 8 devices: device matrix, input/output layouts, forward comms;
each plan executed rank by rank (`simulate`) reproduces the single-device result."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.ops import (
    RULES,
    Comm,
    Flatten,
    MatMul,
    ReLU,
    name_primitives,
    plan_primitive,
)

Sim = Callable[..., None]
X, W1, W2, W3 = (32, 784), (784, 512), (512, 512), (512, 10)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def dims(layout: TensorLayout) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(layout.matrix.names[a] for a in axes) for axes in layout.dims)


def test_matmul1_2x4_4x1(simulate: Sim) -> None:
    mm = MatMul().shard(((2, 4), (4, 1)))
    plan = plan_primitive(mm, X, W1, device_num=8)
    assert plan.device_matrix == (2, 4, 1)
    assert [dims(t) for t in plan.inputs] == [(("d0",), ("d1",)), (("d1",), ())]
    assert dims(plan.outputs[0]) == (("d0",), ())
    assert plan.comms == (Comm("AllReduce", ("d1",)),)
    assert plan.comms[0].group_size(plan.matrix) == 4
    assert plan.comms[0].group(plan.matrix, 5) == (4, 5, 6, 7)
    assert plan.local_input_shapes() == ((16, 196), (196, 512))
    assert plan.local_output_shapes() == ((16, 512),)
    assert plan.user_set
    assert str(plan) == (
        "MatMul [d0=2, d1=4, d2=1]: (d0, d1), (d1, None) -> (d0, None); AllReduce(sum) over d1"
    )
    simulate(mm, plan, [rand(*X), rand(*W1)])


def test_relu1_4x1_repeats_twice(simulate: Sim) -> None:
    relu = ReLU().shard(((4, 1),))
    plan = plan_primitive(relu, (32, 512), device_num=8)
    assert plan.matrix == DeviceMatrix((4, 1, 2), ("d0", "d1", "repeat"))
    assert dims(plan.inputs[0]) == dims(plan.outputs[0]) == (("d0",), ())
    assert plan.comms == ()
    assert plan.outputs[0].local_slice(3, (32, 512))[0] == slice(8, 16)  # ranks 2, 3: rows 8:16
    simulate(relu, plan, [rand(32, 512)])


def test_matmul2_1x8_8x1_allreduces_over_8(simulate: Sim) -> None:
    mm = MatMul().shard(((1, 8), (8, 1)))
    plan = plan_primitive(mm, (32, 512), W2, device_num=8)
    assert plan.device_matrix == (1, 8, 1)
    assert dims(plan.outputs[0]) == ((), ())
    assert plan.comms == (Comm("AllReduce", ("d1",)),)
    assert plan.comms[0].group(plan.matrix, 3) == tuple(range(8))
    simulate(mm, plan, [rand(32, 512), rand(*W2)])


def test_relu2_8x1(simulate: Sim) -> None:
    relu = ReLU().shard(((8, 1),))
    plan = plan_primitive(relu, (32, 512), device_num=8)
    assert plan.device_matrix == (8, 1) and plan.comms == ()
    simulate(relu, plan, [rand(32, 512)])


def test_matmul3_without_strategy_is_data_parallel(simulate: Sim) -> None:
    mm = MatMul()
    plan = plan_primitive(mm, (32, 512), W3, device_num=8)
    assert plan.device_matrix == (8, 1, 1)
    assert [dims(t) for t in plan.inputs] == [(("d0",), ()), ((), ())]  # ((8, 1), (1, 1))
    assert plan.comms == () and not plan.user_set
    assert plan.grad_reduce_axes(1) == ("d0",)  # the replicated weight's gradient
    simulate(mm, plan, [rand(32, 512), rand(*W3)])


def test_flatten_default_splits_the_batch(simulate: Sim) -> None:
    flat = Flatten()
    plan = plan_primitive(flat, (32, 1, 28, 28), device_num=8)
    assert plan.output_shapes == ((32, 784),) and dims(plan.outputs[0]) == (("d0",), ())
    simulate(flat, plan, [rand(32, 1, 28, 28)])


def test_layout_matmul1_allreduces_over_sp_and_dp(simulate: Sim) -> None:
    layout = sw.Layout((2, 2, 2), ("dp", "sp", "mp"))
    mm = MatMul().shard((layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None")))
    plan = plan_primitive(mm, X, W1, device_num=8)
    assert plan.matrix == layout.matrix
    assert dims(plan.outputs[0]) == (("mp",), ())
    assert plan.comms == (Comm("AllReduce", ("sp", "dp")),)
    assert plan.comms[0].group(plan.matrix, 0) == (0, 4, 2, 6)  # block sp*2 + dp
    assert plan.grad_reduce_axes(1) == ("mp",)
    simulate(mm, plan, [rand(*X), rand(*W1)])


def test_layout2_matmul2_allreduces_over_tp(simulate: Sim) -> None:
    layout2 = sw.Layout((8,), ("tp",))
    mm = MatMul().shard((layout2("None", "tp"), layout2("tp", "None")))
    plan = plan_primitive(mm, (32, 512), W2, device_num=8)
    assert dims(plan.outputs[0]) == ((), ())
    assert plan.comms == (Comm("AllReduce", ("tp",)),)
    assert str(plan.comms[0]) == "AllReduce(sum) over tp"
    simulate(mm, plan, [rand(32, 512), rand(*W2)])


class Network(torch.nn.Module):
    """Seed 003's network (strategies only; weights are not needed to plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = Flatten()
        self.matmul1 = MatMul().shard(((2, 4), (4, 1)))
        self.relu1 = ReLU().shard(((4, 1),))
        self.matmul2 = MatMul().shard(((1, 8), (8, 1)))
        self.relu2 = ReLU().shard(((8, 1),))
        self.matmul3 = MatMul()


def test_whole_seed_network_plans_by_module_path() -> None:
    net = Network()
    name_primitives(net, "net")
    shapes = {
        "flatten": [(32, 1, 28, 28)],
        "matmul1": [X, W1],
        "relu1": [(32, 512)],
        "matmul2": [(32, 512), W2],
        "relu2": [(32, 512)],
        "matmul3": [(32, 512), W3],
    }
    plans = {k: plan_primitive(getattr(net, k), *v, device_num=8) for k, v in shapes.items()}
    comms = {k: [str(c) for c in p.comms] for k, p in plans.items() if p.comms}
    assert comms == {
        "matmul1": ["AllReduce(sum) over d1"],
        "matmul2": ["AllReduce(sum) over d1"],
    }
    assert str(plans["matmul1"]).startswith("net.matmul1 (MatMul) [d0=2, d1=4, d2=1]")
    assert plans["matmul3"].who == "net.matmul3 (MatMul)"


@pytest.mark.parametrize("out", [((8, 1),), "layout"])
def test_out_strategy_asks_for_a_reduce_scatter(simulate: Sim, out: object) -> None:
    if out == "layout":
        layout = sw.Layout((2, 4), ("dp", "mp"))
        mm = MatMul().shard(
            (layout("dp", "mp"), layout("mp", "None")), (layout(("dp", "mp"), "None"),)
        )
        axis = "mp"
    else:
        mm = MatMul().shard(((2, 4), (4, 1)), out)
        axis = "d1"
    plan = plan_primitive(mm, X, W1, device_num=8)
    assert plan.comms == (Comm("ReduceScatter", (axis,), dim=0),)
    assert plan.outputs[0].split_count(0) == 8
    assert plan.local_output_shapes() == ((4, 512),)
    simulate(mm, plan, [rand(*X), rand(*W1)])


SIZE1 = sw.Layout((2, 1, 4), ("dp", "sp", "mp"))  # sp splits nothing


@pytest.mark.parametrize(
    "out", [(("dp", "sp", "mp"), "None"), (("dp", "mp"), "None"), (("dp", "mp"), "sp")]
)
def test_out_strategy_may_name_a_summed_axis_of_size_1(simulate: Sim, out: tuple) -> None:
    # K is split over (sp, mp), sp of size 1: naming sp in the output, as the docs say (the
    # summed axes in the order they split K), or leaving it out is the same ReduceScatter.
    x, w = SIZE1("dp", ("sp", "mp")), SIZE1(("sp", "mp"), "None")
    asked = SIZE1(*out)
    mm = MatMul().shard((x, w), (asked,))
    plan = plan_primitive(mm, (16, 16), (16, 8), device_num=8)
    assert plan.comms == (Comm("ReduceScatter", ("mp",), dim=0),)
    for rank in range(8):  # every rank holds the block the asked layout gives it
        assert plan.outputs[0].local_slice(rank, (16, 8)) == asked.local_slice(rank, (16, 8))
    simulate(mm, plan, [rand(16, 16), rand(16, 8)])


def test_out_strategy_with_a_size_1_axis_still_refuses_another_order() -> None:
    x, w = SIZE1("dp", ("sp", "mp")), SIZE1(("sp", "mp"), "None")
    mm = MatMul().shard((x, w), (SIZE1(("mp", "sp", "dp"), "None"),))
    with pytest.raises(ValueError, match=r"does not follow from the input strategy; valid: "):
        plan_primitive(mm, (16, 16), (16, 8), device_num=8)


def test_out_strategy_equal_to_the_default_keeps_the_allreduce() -> None:
    mm = MatMul().shard(((2, 4), (4, 1)), ((2, 1),))
    assert plan_primitive(mm, X, W1, device_num=8).comms == (Comm("AllReduce", ("d1",)),)


def test_plans_at_1024_devices() -> None:
    mm = MatMul().shard(((32, 32), (32, 1)))
    plan = plan_primitive(mm, (1024, 4096), (4096, 1024), device_num=1024)
    assert plan.comms[0].group_size(plan.matrix) == 32
    relu = plan_primitive(ReLU().shard(((16, 1),)), (1024, 8), device_num=1024)
    assert relu.device_matrix == (16, 1, 64)


def test_rule_called_directly() -> None:
    plan = RULES["MatMul"](
        {"op": "MatMul", "transpose_a": False, "transpose_b": True},
        ((2, 4), (1, 4)),
        None,
        [(32, 784), (512, 784)],
        8,
        "mm",
    )
    assert plan.device_matrix == (2, 4, 1) and plan.comms == (Comm("AllReduce", ("d1",)),)
    assert plan.output_shapes == ((32, 512),)
