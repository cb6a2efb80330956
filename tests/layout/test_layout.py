"""`Layout`: construction, the call form, the seed-003 device-coordinate table, every error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardwise.layout import (
    DeviceMatrix,
    Layout,
    LayoutTypeError,
    TensorLayout,
    tensor_layout_from_dict,
    tensor_layout_to_dict,
    tensor_map,
)
from shardwise.layout import strided as sw_strided

LAYOUT = Layout((2, 2, 2), ("dp", "sp", "mp"))

# Seed 003: matmul1 = MatMul().shard((layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None")))
# with x: [32, 784] and fc1_weight: [784, 512]. Derived by hand: x dim 0 is cut in 2 by mp (16
# rows each); x dim 1 in 4 by (sp outer, dp inner), block sp*2 + dp (196 columns each); the weight
# dim 0 like x dim 1, its dim 1 whole.
#   (dp, sp, mp): (x rows, x cols, weight rows, weight cols)
SEED_003_TABLE = {
    (0, 0, 0): ((0, 16), (0, 196), (0, 196), (0, 512)),
    (0, 0, 1): ((16, 32), (0, 196), (0, 196), (0, 512)),
    (0, 1, 0): ((0, 16), (392, 588), (392, 588), (0, 512)),
    (0, 1, 1): ((16, 32), (392, 588), (392, 588), (0, 512)),
    (1, 0, 0): ((0, 16), (196, 392), (196, 392), (0, 512)),
    (1, 0, 1): ((16, 32), (196, 392), (196, 392), (0, 512)),
    (1, 1, 0): ((0, 16), (588, 784), (588, 784), (0, 512)),
    (1, 1, 1): ((16, 32), (588, 784), (588, 784), (0, 512)),
}


def _ranges(slices: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in slices)


def test_seed_003_device_coordinate_table() -> None:
    x = LAYOUT("mp", ("sp", "dp"))
    w = LAYOUT(("sp", "dp"), "None")
    assert x.local_shape((32, 784)) == (16, 196)
    assert w.local_shape((784, 512)) == (196, 512)
    for (dp, sp, mp), (xr, xc, wr, wc) in SEED_003_TABLE.items():
        rank = LAYOUT.matrix.rank((dp, sp, mp))
        assert rank == 4 * dp + 2 * sp + mp
        assert LAYOUT.matrix.coord(rank) == (dp, sp, mp)
        assert _ranges(x.local_slice(rank, (32, 784))) == (xr, xc), (dp, sp, mp)
        assert _ranges(w.local_slice(rank, (784, 512))) == (wr, wc), (dp, sp, mp)


def test_call_form_dims() -> None:
    assert LAYOUT("mp", ("sp", "dp")).dims == ((2,), (1, 0))
    assert LAYOUT(("sp", "dp"), "None").dims == ((1, 0), ())
    assert LAYOUT("dp", None, ("mp",)).dims == ((0,), (), (2,))
    assert LAYOUT().dims == ()
    assert LAYOUT("dp", "mp").matrix is LAYOUT.matrix


def test_layout_is_frozen_and_hashable() -> None:
    assert Layout((2, 4), ("dp", "mp")) == Layout([2, 4], ["dp", "mp"])
    assert len({Layout((2, 4), ("dp", "mp")), Layout((2, 4), ("dp", "mp"))}) == 1
    with pytest.raises(AttributeError):
        LAYOUT.matrix = DeviceMatrix((8,), ("x",))  # type: ignore[misc]


def test_str_and_repr() -> None:
    assert str(LAYOUT) == "Layout(dp=2, sp=2, mp=2)"
    assert repr(LAYOUT) == "Layout((2, 2, 2), ('dp', 'sp', 'mp'))"
    custom = Layout((2, 2), ("a", "b"), [3, 2, 1, 0])
    assert str(custom) == "Layout(a=2, b=2, ranks=[3, 2, 1, 0])"
    assert repr(custom) == "Layout((2, 2), ('a', 'b'), [3, 2, 1, 0])"
    assert str(LAYOUT("mp", ("sp", "dp"))) == "(mp, (sp, dp)) on DeviceMatrix(dp=2, sp=2, mp=2)"


def test_accessors_and_rank_list() -> None:
    layout = Layout((2, 2), ("a", "b"), [4, 5, 6, 7])
    assert layout.device_matrix == (2, 2)
    assert layout.alias_name == ("a", "b")
    assert layout.rank_list == (4, 5, 6, 7)
    x = layout("b", "None")
    assert _ranges(x.local_slice(5, (4, 2))) == ((2, 4), (0, 2))
    assert layout.matrix.coord(6) == (1, 0)


def test_numpy_integers_are_taken_as_ints() -> None:
    """NumPy integers in a device matrix or rank list were refused ("must be a tuple of
    ints"), where call arguments (ReduceSum's axis) take them."""
    layout = Layout((np.int64(2), np.int32(2)), ("a", "b"), list(np.arange(4, 8)))
    assert layout == Layout((2, 2), ("a", "b"), [4, 5, 6, 7])
    assert all(type(v) is int for v in (*layout.device_matrix, *layout.rank_list))
    with pytest.raises(LayoutTypeError, match="device_matrix must be a tuple of ints"):
        Layout((np.float64(2.0), 2), ("a", "b"))


def test_dicts_round_trip_through_json() -> None:
    d = LAYOUT.to_dict()
    assert d == {"device_matrix": [2, 2, 2], "alias_name": ["dp", "sp", "mp"],
                 "rank_list": list(range(8))}  # fmt: skip
    assert Layout.from_dict(json.loads(json.dumps(d))) == LAYOUT
    for t in (LAYOUT("dp", "mp"), LAYOUT("mp", ("sp", "dp")), LAYOUT("None", ("mp", "dp", "sp"))):
        data = json.loads(json.dumps(tensor_layout_to_dict(t)))
        assert tensor_layout_from_dict(data) == t


def test_tensor_map_counts_axes_from_the_right() -> None:
    # MindSpore's example: Layout((2, 2, 2), ("dp", "sp", "mp"))("dp", "mp") -> tensor_map (2, 0)
    assert tensor_map(LAYOUT("dp", "mp")) == (2, 0)
    assert tensor_map(LAYOUT("mp", ("sp", "dp"))) == (0, (1, 2))
    assert tensor_map(LAYOUT(("sp", "dp"), "None")) == ((1, 2), -1)
    assert tensor_layout_to_dict(LAYOUT("None", "sp"))["tensor_map"] == [-1, 1]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("tp", "None"), r"unknown alias 'tp'; this layout's aliases are \['dp', 'sp', 'mp'\]"),
        (("dp", ("sp", "dp")), r"alias 'dp' is used by dims 0 and 1"),
        ((("mp", "mp"),), r"alias 'mp' is used twice in dim 0; each alias may split"),
        (((), "dp"), r"dim 0: empty tuple; use 'None'"),
        ((("sp", "None"),), r"'None' cannot be part of a tuple"),
        ((("sp", "xx"),), r"unknown alias 'xx'"),
    ],
)
def test_call_errors(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LAYOUT(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [3, ["dp", "sp"], (("dp",),), ("dp", 1)])
def test_call_wrong_types(bad: object) -> None:
    with pytest.raises(LayoutTypeError, match="expected an alias, 'None' or a tuple of aliases"):
        LAYOUT(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LAYOUT(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((2, 2), ("dp", "dp")), ValueError, r"repeats \['dp'\]; every axis needs its own alias"),
        (((2, 2), ("dp",)), ValueError, r"has 2 axes but alias_name \('dp',\) has 1 names"),
        (((2, 2), ("dp", "None")), ValueError, r"alias 'None' .* is reserved"),
        (((2, 2), ("dp", "")), ValueError, r"alias '' .* is reserved or empty"),
        (((2, 0), ("a", "b")), ValueError, r"every size >= 1"),
        (((), ()), ValueError, r"at least one axis"),
        (((2, 2), ("a", "b"), [0, 1, 2]), ValueError,
         r"rank_list has 3 ranks but device_matrix \(2, 2\) holds 4 devices"),
        (((2, 2), ("a", "b"), [0, 1, 1, 2]), ValueError, r"distinct ranks"),
        (((2, 2.0), ("a", "b")), LayoutTypeError, r"device_matrix must be a tuple of ints"),
        ((8, ("a",)), LayoutTypeError, r"device_matrix must be a tuple of ints"),
        (((True, 2), ("a", "b")), LayoutTypeError, r"device_matrix must be a tuple of ints"),
        (((2, 2), "ab"), LayoutTypeError, r"alias_name must be a tuple of str"),
        (((2, 2), ("a", 1)), LayoutTypeError, r"alias_name must be a tuple of str"),
        (((2, 2), ("a", "b"), "0123"), LayoutTypeError, r"rank_list must be a tuple of ints"),
        (((2, 2), ("a", "interleaved_parallel")), ValueError, r"not supported.*drop it"),
    ],
)  # fmt: skip
def test_constructor_errors(args: tuple[object, ...], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Layout(*args)  # type: ignore[arg-type]


def test_type_errors_are_value_errors_too() -> None:
    with pytest.raises(ValueError):
        Layout(8, ("a",))  # type: ignore[arg-type]


def test_tensor_layout_from_dict_rejects_bad_tensor_map() -> None:
    data = {**LAYOUT.to_dict(), "tensor_map": [3, -1]}
    with pytest.raises(ValueError, match=r"tensor_map entry 3 is not in 0..2 or -1"):
        tensor_layout_from_dict(data)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"groups": [2.5, 1]}, r"groups \[2\.5, 1\]: give one int >= 1 per tensor_map entry"),
        ({"groups": ["a", 1]}, r"groups \['a', 1\]: give one int >= 1 per tensor_map entry"),
        ({"groups": [2]}, r"groups \[2\]: give one int >= 1 per tensor_map entry \(2\)"),
        ({"groups": [0, 1]}, r"groups \[0, 1\]: give one int >= 1"),
        ({"tensor_map": [[], -1]}, r"tensor_map entry \[\] .*non-empty list"),
        ({"tensor_map": [2.0, -1]}, r"tensor_map entry 2\.0 is not in 0\.\.2 or -1"),
        ({"tensor_map": "ab"}, r"tensor_map must be a list"),
        (
            {"tensor_map": [0, 0]},
            r"tensor_map \[0, 0\]: axis index 0 \('mp'\) is given by entries 0 \(0\) and 1 \(0\); "
            r"an axis splits at most one dim, once: give -1 \(not split\) or another axis index",
        ),
        (
            {"tensor_map": [[1, 1], -1]},
            r"axis index 1 \('sp'\) is given by entry 0 \(\[1, 1\]\) twice",
        ),
        ({"tensor_map": None}, r"tensor_map must be a list"),
    ],
    ids=str,
)
def test_tensor_layout_from_dict_refuses_malformed_values(
    change: dict[str, object], match: str
) -> None:
    """A hand-edited strategy dict is refused with the key named, never silently cut (a group
    count 2.5 read as 2) or read as something else (an empty list as "not split")."""
    data = {**tensor_layout_to_dict(LAYOUT("mp", "None")), **change}
    with pytest.raises(ValueError, match=match):
        tensor_layout_from_dict(data)


@pytest.mark.parametrize("key", ["device_matrix", "alias_name", "tensor_map"])
def test_tensor_layout_from_dict_names_a_missing_key(key: str) -> None:
    data = tensor_layout_to_dict(LAYOUT("mp", "None"))
    del data[key]
    with pytest.raises(ValueError, match=rf"has no '{key}' key; give device_matrix"):
        tensor_layout_from_dict(data)


def test_tensor_layout_from_dict_reads_valid_dicts_as_before() -> None:
    base = {"device_matrix": [2, 2, 2], "alias_name": ["dp", "sp", "mp"]}
    read = tensor_layout_from_dict
    assert read({**base, "tensor_map": [[-1], [0, 1]]}) == LAYOUT("None", ("mp", "sp"))
    assert read({**base, "tensor_map": [2, -1], "groups": None}) == LAYOUT("dp", "None")
    assert read({**base, "tensor_map": [2, -1], "groups": []}) == LAYOUT("dp", "None")
    strided = read({**base, "tensor_map": [2, -1], "groups": [3, 1]})
    assert strided == LAYOUT(sw_strided("dp", 3), "None")


def test_core_errors_name_what_is_wrong() -> None:
    m = LAYOUT.matrix
    with pytest.raises(TypeError, match=r"dims \(0,\): give one tuple of axis indices per"):
        TensorLayout(m, (0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tuple of axis indices"):
        TensorLayout(m, ((0.0,), ()))  # type: ignore[arg-type]
    assert TensorLayout(m, [[0], []]) == TensorLayout(m, ((0,), ()))  # type: ignore[arg-type]
    one_dim = r"; a device axis splits at most one dim, once: use another axis or 'None' for one"
    with pytest.raises(ValueError, match=r"device axis 'mp' splits dims 0 and 1 .*" + one_dim):
        TensorLayout(m, ((2,), (2,)))
    with pytest.raises(ValueError, match=r"device axis 'dp' splits dim 1 twice"):
        TensorLayout(m, ((), (0, 0)))
    with pytest.raises(ValueError, match=r"coordinate \(0,\) has 1 entries but .* 3 axes"):
        m.rank((0,))
    x = LAYOUT("dp", "None")
    with pytest.raises(ValueError, match=r"dim 0 has size -4; a global shape holds ints >= 0"):
        x.local_shape((-4, 2))
    with pytest.raises(ValueError, match=r"dim 1 has size 2\.0; a global shape holds ints"):
        x.local_shape((4, 2.0))  # type: ignore[arg-type]
    assert x.local_shape((0, 2)) == (0, 2)


def test_call_result_is_a_core_tensor_layout() -> None:
    t = LAYOUT("mp", ("sp", "dp"))
    assert isinstance(t, TensorLayout)
    assert t == TensorLayout(LAYOUT.matrix, ((2,), (1, 0)))
