"""Strided layouts (`TensorLayout.groups`, ``sw.strided``): the layout call, the DTensor
placements (``_StridedShard`` with the group count folded into its split factor) checked
exhaustively against torch's own splitting code, the inverse mapping, strategy-file dicts,
refinement onto a finer matrix, primitives refusing them, and the split rule
(`ops.aten_rules.strided_split_rule`) that keeps each part of a strided dim split."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardwise as sw
from shardwise.layout import (
    DeviceMatrix,
    LayoutTypeError,
    TensorLayout,
    from_placements,
    refine,
    tensor_layout_from_dict,
    tensor_layout_to_dict,
    to_placements,
)
from shardwise.ops import MatMul, plan_primitive
from shardwise.ops._dtensor import Spec, mesh_of
from shardwise.ops.aten_rules import decide

from .test_dtensor import all_layouts, simulate

LAYOUT = sw.Layout((2, 4), ("dp", "mp"))


def test_the_layout_call() -> None:
    w = LAYOUT(sw.strided("mp", 3), "None")
    assert w.dims == ((1,), ()) and w.groups == (3, 1) and w.strided
    assert str(w) == "(strided(mp, 3), None) on DeviceMatrix(dp=2, mp=4)"
    assert repr(sw.strided(("dp", "mp"), 2)) == "strided(('dp', 'mp'), 2)"
    assert LAYOUT(sw.strided(("dp", "mp"), 2)).dims == ((0, 1),)
    assert LAYOUT(sw.strided("mp", 1), "None") == LAYOUT("mp", "None")  # 1 group: plain
    assert TensorLayout(LAYOUT.matrix, ((), ()), (3, 1)) == LAYOUT("None", "None")
    assert w.plain() == LAYOUT("mp", "None")
    assert w.local_shape((96, 32)) == (24, 32)
    with pytest.raises(ValueError, match="groups must be >= 1"):
        sw.strided("mp", 0)
    with pytest.raises(ValueError, match="'None' cannot be strided"):
        sw.strided("None", 3)
    with pytest.raises(LayoutTypeError, match="groups must be an int"):
        sw.strided("mp", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown alias 'tp'"):
        LAYOUT(sw.strided("tp", 3), "None")
    with pytest.raises(ValueError, match="one group count >= 1 per tensor dim"):
        TensorLayout(LAYOUT.matrix, ((1,), ()), (3,))


def test_a_group_count_that_does_not_divide_suggests_a_strided_call_that_works() -> None:
    """The error for a strided dim over several axes suggests the `strided` call to write (a
    tuple of aliases), and that call, with a k that divides, is accepted and fits the shape."""
    layout = sw.Layout((2, 4), ("dp", "sp"))
    with pytest.raises(ValueError) as info:
        layout(sw.strided(("dp", "sp"), 2), "None").local_shape((24, 4))
    message = str(info.value)
    assert (
        "(axes dp*sp)" in message and "strided(('dp', 'sp'), k) with k x 8 dividing 24" in message
    )
    call = message.split("(strided(")[1].split(", k)")[0]
    fixed = eval(f"sw.strided({call}, 3)")  # the suggestion with k = 3 (3 x 8 divides 24)
    assert layout(fixed, "None").local_shape((24, 4)) == (3, 4)
    with pytest.raises(ValueError, match=r"\(axis sp\).*strided\('sp', k\) with k x 4"):
        layout(sw.strided("sp", 5), "None").local_shape((24, 4))


@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2), (3, 2, 2), (2, 1, 4), (8,)], ids=str)
def test_placements_match_torch_splitting_for_strided_2d_layouts(shape: tuple[int, ...]) -> None:
    matrix = DeviceMatrix(shape, tuple(f"a{i}" for i in range(len(shape))))
    n = matrix.size * 6
    full = torch.arange(n * n).reshape(n, n)
    count = 0
    for plain in all_layouts(matrix, 2):
        for groups in itertools.product((1, 2, 3), repeat=2):
            layout = TensorLayout(matrix, plain.dims, groups)
            placements = to_placements(layout)
            for rank in matrix.rank_list:
                got = simulate(full, matrix, placements, rank)
                want = full[layout.local_index(rank, full.shape)]
                assert torch.equal(got, want), (str(layout), placements, rank)
            back = from_placements(matrix, placements, 2)
            squeezed = tuple(tuple(a for a in d if shape[a] > 1) for d in layout.dims)
            assert (back.dims, back.groups) == (squeezed, layout.groups), (layout, back)
            count += 1
    assert count > 0


def test_placements_of_the_fused_projection() -> None:
    w = LAYOUT(sw.strided("mp", 3), "None")
    assert to_placements(w) == (Replicate(), _StridedShard(0, split_factor=3))
    # ("mp", "dp") in 3 groups: dp comes first in mesh order but sits under mp in the tuple,
    # so its factor counts mp (4) and the groups (3); mp, the outermost axis, the groups only
    both = LAYOUT(sw.strided(("mp", "dp"), 3))
    assert to_placements(both) == (
        _StridedShard(0, split_factor=12), _StridedShard(0, split_factor=3)
    )  # fmt: skip
    assert from_placements(LAYOUT.matrix, to_placements(both), 1) == both


def test_dicts_and_refinement_keep_the_groups() -> None:
    w = LAYOUT(sw.strided("mp", 3), "None")
    data = tensor_layout_to_dict(w)
    assert data["groups"] == [3, 1] and tensor_layout_from_dict(data) == w
    assert "groups" not in tensor_layout_to_dict(LAYOUT("mp", "None"))
    fine = DeviceMatrix((2, 2, 2), ("m0", "m1", "m2"))
    assert refine(w, fine) == TensorLayout(fine, ((1, 2), ()), (3, 1))


def test_primitives_take_plain_layouts_only() -> None:
    mm = MatMul().shard((LAYOUT("dp", "None"), LAYOUT("None", sw.strided("mp", 3))))
    with pytest.raises(ValueError, match=r"input 1 \(w\) is laid out strided .* plain layouts"):
        plan_primitive(mm, (8, 16), (16, 96), device_num=8)


def _split(placements: tuple[object, ...], sizes: int | list[int], dim: int = 2) -> object:
    mesh = mesh_of((2, 2), ("dp", "mp"), (0, 1, 2, 3))
    x = Spec(placements, (8, 16, 96), (1536, 96, 1), "float32")  # type: ignore[arg-type]
    op = (
        torch.ops.aten.split.Tensor
        if isinstance(sizes, int)
        else torch.ops.aten.split_with_sizes.default
    )
    return decide(op, [x, sizes, dim], {}, mesh, 2)


def test_split_keeps_each_group_split() -> None:
    q = (Shard(0), _StridedShard(2, split_factor=3))
    dec = _split(q, 32)
    assert dec.source == "shardwise" and dec.inputs == (q,)  # type: ignore[attr-defined]
    assert dec.outputs == ((Shard(0), Shard(2)),) * 3  # type: ignore[attr-defined]
    # q alone and k, v together: 1 group, then a strided part of 2 groups
    dec = _split(q, [32, 64])
    assert dec.outputs == (  # type: ignore[attr-defined]
        (Shard(0), Shard(2)), (Shard(0), _StridedShard(2, split_factor=2))
    )  # fmt: skip
    # partial values stay partial (split is linear)
    partial = (Partial(), _StridedShard(2, split_factor=3))
    assert _split(partial, 32).outputs == ((Partial(), Shard(2)),) * 3  # type: ignore[attr-defined]


def test_split_that_cuts_a_group_is_dtensors() -> None:
    """Parts across the groups (48 of 96 with 3 groups of 32), a plain Shard on the split dim,
    or another dim split: DTensor's rule (the split dim gathered, other dims kept)."""
    strided = (Replicate(), _StridedShard(2, split_factor=3))
    assert _split(strided, 48).inputs == ((Replicate(), Replicate()),)  # type: ignore[attr-defined]
    assert _split((Replicate(), Shard(2)), 32).source == "dtensor"  # type: ignore[attr-defined]
    other = _split((Shard(0), Replicate()), 32)
    assert other.source == "dtensor"  # type: ignore[attr-defined]
    assert other.outputs == ((Shard(0), Replicate()),) * 3  # type: ignore[attr-defined]
