"""Int and Layout strategies -> a primitive's device matrix and input layouts (seed 003 lines)."""

from __future__ import annotations

import pytest

from shardwise.layout import (
    Layout,
    LayoutTypeError,
    StrategyLayouts,
    TensorLayout,
    check_int_strategy,
    check_layout_strategy,
    data_parallel_strategy,
    elementwise_axes,
    iter_rank_slices,
    resolve_strategy,
    strategy_kind,
    strategy_layouts,
)

MATMUL = [[0, 1], [1, 2]]  # x [M, K] -> axes (0, 1); w [K, N] -> axes (1, 2)
Ranges = tuple[tuple[int, int], ...]


def held(layout: TensorLayout, shape: tuple[int, ...]) -> list[Ranges]:
    """Per rank (0..7), the (start, stop) of every dim it holds."""
    return [tuple((s.start, s.stop) for s in sl) for _, sl in iter_rank_slices(layout, shape)]


def rows(*starts: int, n: int, cols: tuple[int, int]) -> list[Ranges]:
    return [((s, s + n), cols) for s in starts]


def test_matmul1_2x4_4x1() -> None:
    # self.matmul1 = MatMul().shard(((2, 4), (4, 1))); x [32, 784], w [784, 512]
    res = strategy_layouts(((2, 4), (4, 1)), 8, MATMUL, shapes=[(32, 784), (784, 512)])
    assert res.matrix.shape == (2, 4, 1) and res.matrix.names == ("d0", "d1", "d2")
    assert res.repeat == 1
    x, w = res.layouts
    assert held(x, (32, 784)) == [
        ((0, 16), (0, 196)), ((0, 16), (196, 392)), ((0, 16), (392, 588)), ((0, 16), (588, 784)),
        ((16, 32), (0, 196)), ((16, 32), (196, 392)), ((16, 32), (392, 588)),
        ((16, 32), (588, 784)),
    ]  # fmt: skip
    assert held(w, (784, 512)) == 2 * rows(0, 196, 392, 588, n=196, cols=(0, 512))
    assert str(res) == "[(d0, d1), (d1, None)] on DeviceMatrix(d0=2, d1=4, d2=1)"


def test_relu1_4x1_repeats_on_the_right() -> None:
    # self.relu1 = ReLU().shard(((4, 1),)) on 8 devices: 4 slices, 2 replicas each
    res = strategy_layouts(((4, 1),), 8, shapes=[(32, 512)])
    assert res.matrix.shape == (4, 1, 2) and res.matrix.names == ("d0", "d1", "repeat")
    assert res.repeat == 2
    (x,) = res.layouts
    assert held(x, (32, 512)) == rows(0, 0, 8, 8, 16, 16, 24, 24, n=8, cols=(0, 512))
    # consecutive ranks hold replicas: the repeat axis is the fastest
    assert [res.matrix.group_along(r, [2]) for r in (0, 2, 4, 6)] == [
        (0, 1), (2, 3), (4, 5), (6, 7)
    ]  # fmt: skip
    assert x.replicated_axes() == (1, 2)


def test_matmul2_1x8_8x1() -> None:
    res = strategy_layouts(((1, 8), (8, 1)), 8, MATMUL, shapes=[(32, 512), (512, 512)])
    assert res.matrix.shape == (1, 8, 1)
    x, w = res.layouts
    assert x.dims == ((), (1,)) and w.dims == ((1,), ())  # size-1 axes split nothing
    assert held(x, (32, 512)) == [((0, 32), (64 * r, 64 * r + 64)) for r in range(8)]
    assert held(w, (512, 512)) == rows(*range(0, 512, 64), n=64, cols=(0, 512))


def test_relu2_8x1() -> None:
    (x,) = strategy_layouts(((8, 1),), 8, shapes=[(32, 512)]).layouts
    assert held(x, (32, 512)) == rows(*range(0, 32, 4), n=4, cols=(0, 512))


def test_matmul3_without_strategy_is_data_parallel() -> None:
    strategy = data_parallel_strategy([2, 2], 8, [True, False])
    assert strategy == ((8, 1), (1, 1))
    res = strategy_layouts(strategy, 8, MATMUL, shapes=[(32, 512), (512, 10)])
    assert res.matrix.shape == (8, 1, 1)
    x, w = res.layouts
    assert held(x, (32, 512)) == rows(*range(0, 32, 4), n=4, cols=(0, 512))
    assert held(w, (512, 10)) == [((0, 512), (0, 10))] * 8
    assert data_parallel_strategy([2, 0, 1], 4) == ((4, 1), (), (4,))


def test_fewer_devices_used_and_transposed_rule() -> None:
    # MatMul(transpose_b=True): w is [N, K] -> axes (2, 1); 2*2*1 = 4 of 8 devices
    res = strategy_layouts(((2, 2), (1, 2)), 8, [[0, 1], [2, 1]])
    assert res.matrix.shape == (2, 2, 1, 2) and res.repeat == 2
    assert res.layouts[1].dims == ((), (1,))


def test_scalars_only_get_a_repeat_axis() -> None:
    res = strategy_layouts(((),), 4)
    assert res.matrix.shape == (4,) and res.layouts[0].dims == ()


def test_elementwise_axes_broadcasting() -> None:
    assert elementwise_axes([[32, 512], [512]]) == [[0, 1], [1]]
    assert elementwise_axes([[32, 512], [1, 512]]) == [[0, 1], [None, 1]]
    assert elementwise_axes([[1], [1]]) == [[0], [0]]
    res = strategy_layouts(((4, 2), (1, 2)), 8, shapes=[(32, 512), (1, 512)])
    assert res.layouts[1].dims == ((), (1,))


def test_layout_strategy_checked_and_resolved() -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    strategy = (layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None"))
    assert strategy_kind(strategy) == "layouts"
    res = resolve_strategy(strategy, 8, MATMUL, shapes=[(32, 784), (784, 512)])
    assert isinstance(res, StrategyLayouts)
    assert res.matrix == layout.matrix and res.layouts == strategy
    matrix, (x, w) = check_layout_strategy(strategy, 8)
    assert (x, w) == strategy and matrix is layout.matrix
    assert resolve_strategy(((8, 1),), 8).layouts[0].dims == ((0,), ())


WHO = "net.matmul1 (MatMul)"


@pytest.mark.parametrize(
    ("strategy", "kwargs", "match"),
    [
        (((3, 1),), {}, r"strategy \(\(3, 1\),\) uses 3 devices \(device matrix \[3, 1\]\), "
         r"which does not divide the device count 8; the product must be one of \[1, 2, 4, 8\]"),
        (((4, 4), (4, 1)), {"dims_to_axes": MATMUL}, r"uses 16 devices .* device count 8"),
        (((0, 1),), {}, r"input 0 \(x\) strategy \(0, 1\): every value must be >= 1"),
        (((2, 4, 1), (4, 1)), {"dims_to_axes": MATMUL},
         r"input 0 \(x\) has 2 dims but its strategy \(2, 4, 1\) has 3 values"),
        (((2, 4),), {"dims_to_axes": MATMUL},
         r"strategy \(\(2, 4\),\) has 1 entries but the primitive has 2 inputs"),
        (((2, 4), (2, 1)), {"dims_to_axes": MATMUL},
         r"splits input 1 \(w\) dim 0 into 2 but input 0 \(x\) dim 1 into 4; these dims share"),
        (((2, 4), (4, 1)), {"dims_to_axes": MATMUL, "shapes": [(32, 786), (786, 512)]},
         r"input 0 \(x\): dim 1 of size 786 cannot be split into 4 parts \(axes d1\)"),
        (((2, 4), (4, 1)), {"dims_to_axes": MATMUL, "shapes": [(32, 784, 1), (784, 512)]},
         r"input 0 \(x\): layout .* has 2 dims but the tensor has shape \[32, 784, 1\]"),
        (((4, 1), (2, 1)), {"shapes": [(32, 512), (1, 512)]},
         r"input 1 \(w\) dim 0 cannot be split by this primitive \(strategy \(2, 1\) has 2 "
         r"there\); use 1"),
        (((2, 2),), {"dims_to_axes": [[0, 2]]},
         r"the rule maps no tensor dim to device axes \[1\]"),
    ],
)  # fmt: skip
def test_int_strategy_errors(strategy: object, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        strategy_layouts(strategy, 8, who=WHO, input_names=("x", "w"), **kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(WHO)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        (((2.0, 1),), r"input 0 strategy \(2.0, 1\) must hold ints"),
        (((True, 1),), r"must hold ints"),
        ((), r"a strategy is a non-empty tuple"),
        (8, r"a strategy is a non-empty tuple"),
        (("dp",), r"strategy entry 0 is 'dp'; expected a tuple of ints or a Layout call"),
    ],
)
def test_int_strategy_type_errors(strategy: object, match: str) -> None:
    with pytest.raises(LayoutTypeError, match=match):
        strategy_layouts(strategy, 8)  # type: ignore[arg-type]


def test_mixed_int_and_layout_strategy() -> None:
    layout = Layout((8,), ("tp",))
    mixed = (layout("tp", "None"), (1, 1))
    with pytest.raises(ValueError, match=r"net.matmul2: strategy \(\(tp, None\) on .*\(1, 1\)\) "
                       r"mixes int tuples and Layouts; use one kind for all inputs"):  # fmt: skip
        strategy_kind(mixed, "net.matmul2")
    with pytest.raises(ValueError, match="mixes int tuples and Layouts"):
        resolve_strategy(mixed, 8, MATMUL)  # type: ignore[arg-type]


def test_a_0d_entry_fits_either_kind() -> None:
    layout = Layout((2, 4), ("dp", "mp"))
    assert strategy_kind((layout("dp", "mp"), ())) == "layouts"
    assert strategy_kind(((2, 4), ())) == "ints"
    found = resolve_strategy((layout("dp", "mp"), ()), 8)  # type: ignore[arg-type]
    assert found.layouts == (layout("dp", "mp"), layout())


def test_layout_strategy_errors() -> None:
    a = Layout((2, 4), ("dp", "mp"))
    b = Layout((4, 2), ("dp", "mp"))
    other_matrix = (
        r"m: input 1 is laid out on DeviceMatrix\(dp=4, mp=2\) but input 0 on "
        r"DeviceMatrix\(dp=2, mp=4\); all inputs of one primitive need the same Layout"
    )
    with pytest.raises(ValueError, match=other_matrix):
        check_layout_strategy((a("dp", "mp"), b("mp", "None")), 8, who="m")
    wrong_size = (
        r"DeviceMatrix\(dp=2, mp=4\) holds 8 devices but the job has 16; a Layout's device "
        r"matrix must multiply to exactly 16"
    )
    with pytest.raises(ValueError, match=wrong_size):
        check_layout_strategy((a("dp", "mp"),), 16)
    with pytest.raises(ValueError, match=r"input 0: dim 0 of size 6 cannot be split into 4"):
        check_layout_strategy((a("mp", "None"),), 8, shapes=[(6, 2)])
    with pytest.raises(LayoutTypeError, match="expected Layout calls"):
        check_layout_strategy(((2, 4),), 8)  # type: ignore[arg-type]


def test_check_int_strategy_accepts_lists() -> None:
    assert check_int_strategy([[2, 4], [4, 1]], [2, 2]) == ((2, 4), (4, 1))
