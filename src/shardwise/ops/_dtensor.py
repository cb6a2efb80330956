"""DTensor's sharding strategies for aten ops, queried without a process group.

torch 2.13's DTensor keeps its per-op sharding rules in a private propagator; `_torch.dtensor`
is the only module that touches it (checked by tests/test_torch_private_apis.py), this one
asks it and memoizes the answers.

- `mesh_of`: a `DeviceMesh` of a device matrix's shape built without any process group.
- `has_rule`: whether DTensor knows an aten op.
- `propagate`: the placements DTensor wants for an op's tensor arguments, given theirs, and the
  placements of its outputs. Answers are memoized per query (`_memo`: the op, the mesh shape,
  every argument in hashable form), so repeated layers and repeated plans ask DTensor once. A
  negative dim that DTensor's rule would misread (`NEGATIVE_DIMS`) is normalized first.
- `_per_axis`: the fast path of `propagate` on a mesh of several dims for an op DTensor
  describes per mesh dim (``op_single_dim_strategy_funcs``, whose full-mesh strategies are the
  cartesian product of single-dim ones): each mesh dim is asked on a 1-D mesh of its size
  (memoized too, so shared by every matrix with a dim of that size). When every dim keeps its
  input placements, the full-mesh answer is their combination (DTensor prefers a strategy that
  moves nothing, and the product of the single-dim ones is one), once the combined placements
  split every dim evenly; otherwise the full mesh is asked as before.
- `candidates`: a context in which `_per_axis` also answers when a dim moves an input: the
  combination of the per-dim answers is then *a* strategy DTensor accepts (one of its full-mesh
  products, checked even), not necessarily the one its full-mesh search would prefer. The
  automatic planners generate candidates this way (they rank candidates by their own cost);
  semi_auto, which follows DTensor's preference, does not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardwise._torch import pytree
from shardwise._torch.dtensor import (
    OutMeta,
    StridedShard,
    ask_propagator,
    has_single_dim_rule,
    mesh_without_process_group,
    tensor_spec,
)
from shardwise._torch.dtensor import has_rule as has_rule
from shardwise.ops import _flat as flat

Placements = tuple[Placement, ...]


@functools.lru_cache(maxsize=64)
def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], ranks: tuple[int, ...]) -> DeviceMesh:
    """A mesh of `shape` (`ranks` row-major, dims named `names`); no process group is made."""
    return mesh_without_process_group(shape, names, ranks)


class Spec:
    """A tensor argument for `propagate`: placements, global shape, stride and dtype."""

    def __init__(
        self, placements: Placements, shape: Sequence[int], stride: Sequence[int], dtype: str
    ) -> None:
        self.placements = placements
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        self.dtype = dtype


Answer = tuple[list[Placements], list[Placements | None]]
_memo: dict[object, Answer] = {}
_MEMO_MAX = 200_000
_loose = [False]  # (inside `candidates`)


@contextlib.contextmanager
def candidates() -> Iterator[None]:
    """Within it, `propagate` on a mesh of several dims answers with the combination of the
    per-dim answers even when they move an input (module docstring); the answers are memoized
    apart from the exact ones.

    Example:
        >>> mesh = mesh_of((2, 4), ("a", "b"), tuple(range(8)))
        >>> with candidates():
        ...     ins, outs = propagate(op, args, kwargs, mesh)  # doctest: +SKIP
    """
    before = _loose[0]
    _loose[0] = True
    try:
        yield
    finally:
        _loose[0] = before


def _hashable(args: Sequence[Any], kwargs: Mapping[str, Any]) -> object | None:
    """The arguments as a hashable key (each `Spec` as its fields), None when one is not."""
    return flat.key(Spec, _fields, (tuple(args), dict(kwargs)))


def _fields(s: Spec) -> tuple[Any, ...]:
    return (s.placements, s.shape, s.stride, s.dtype)


# aten ops whose DTensor rule reads a negative dim as given (torch 2.13's scan rule compares it
# with the split dims unnormalized: ``x.cumsum(-1)`` of a tensor split on its last dim kept the
# split and each rank scanned its own block): the dim argument at this position is normalized
# before DTensor is asked.
NEGATIVE_DIMS: dict[str, int] = {
    "aten.cumsum.default": 1,
    "aten.cumprod.default": 1,
    "aten.logcumsumexp.default": 1,
}


def _dim_normalized(op: Any, args: Sequence[Any]) -> Sequence[Any]:
    """`args` with `NEGATIVE_DIMS`'s dim argument of `op` made non-negative."""
    at = NEGATIVE_DIMS.get(str(op))
    if at is None or len(args) <= at or not isinstance(args[0], Spec):
        return args
    dim = args[at]
    if not isinstance(dim, int) or dim >= 0:
        return args
    return (*args[:at], dim + max(len(args[0].shape), 1), *args[at + 1 :])


def propagate(
    op: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: DeviceMesh,
    out_shapes: Sequence[Sequence[int]] | None = None,
    out_meta: Sequence[OutMeta] | None = None,
) -> Answer:
    """DTensor's choice for one aten call (memoized; see the module docstring).

    Args:
        op: the aten overload.
        args / kwargs: its arguments, each tensor given as a `Spec`.
        mesh: from `mesh_of`.
        out_shapes: the global shape of each tensor output, when known: it lets an op DTensor
            describes per mesh dim be asked per dim (`_per_axis`).
        out_meta: each tensor output's global shape, stride and dtype, when known: DTensor
            takes it instead of running the op on fake tensors (`ask_propagator`).

    Returns:
        (the placements each `Spec` argument must have, in pytree order; the placements of each
        of the op's outputs, None for a non-tensor output).

    Raises:
        RuntimeError / NotImplementedError: DTensor's own (no rule; an uneven split it refuses).
    """
    args = _dim_normalized(op, args)
    key = _hashable(args, kwargs)
    if key is not None:
        key = (op, tuple(mesh.shape), _loose[0] and mesh.ndim > 1, key)
        hit = _memo.get(key)
        if hit is not None:
            return hit
    answer = None
    if mesh.ndim > 1 and out_shapes is not None and has_single_dim_rule(op):
        answer = _per_axis(op, args, kwargs, mesh, out_shapes, out_meta)
    if answer is None:
        answer = _full(op, args, kwargs, mesh, out_meta)
    if key is not None:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[key] = answer
    return answer


def _full(
    op: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: DeviceMesh,
    out_meta: Sequence[OutMeta] | None = None,
) -> Answer:
    """Ask DTensor's propagator on the whole mesh."""
    a, k = pytree.tree_map_only(
        Spec,
        lambda s: tensor_spec(mesh, s.placements, s.shape, s.stride, s.dtype),
        (tuple(args), dict(kwargs)),
    )
    return ask_propagator(op, a, k, out_meta)


def _per_axis(
    op: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: DeviceMesh,
    out_shapes: Sequence[Sequence[int]],
    out_meta: Sequence[OutMeta] | None = None,
) -> Answer | None:
    """The full-mesh answer combined from one 1-D answer per mesh dim, or None when some dim
    would move an input (outside `candidates`), a placement is not a plain one, or a combined
    split is uneven."""
    given = [s for s in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(s, Spec)]
    kinds = _LOOSE if _loose[0] else _PLAIN
    if not all(
        type(p) in kinds or (_loose[0] and isinstance(p, Partial))
        for s in given
        for p in s.placements
    ):
        return None  # (a masked partial given is fine for candidates: the answer must reduce it)
    outs: list[list[Placement] | None] = []
    moved = [list(s.placements) for s in given]
    for m, size in enumerate(mesh.shape):
        sub = mesh_of((size,), ("d",), tuple(range(size)))
        one = functools.partial(_axis, m=m)
        a, k = pytree.tree_map_only(Spec, one, (tuple(args), dict(kwargs)))
        try:
            ins, got = propagate(op, a, k, sub, out_meta=out_meta)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError):
            return None
        if len(ins) != len(given) or not all(type(p) in kinds for x in ins for p in x):
            return None
        for j, wanted in enumerate(ins):
            if wanted != (given[j].placements[m],) and not _loose[0]:
                return None  # (an input moves: DTensor's full mesh decides how)
            moved[j][m] = wanted[0]
        if m == 0:
            outs = [None if o is None else [] for o in got]
        if len(got) != len(outs) or len(got) != len(out_shapes):
            return None
        for j, o in enumerate(got):
            row = outs[j]
            if (o is None) != (row is None):
                return None
            if o is not None and row is not None:
                if type(o[0]) not in kinds:  # (e.g. the masked partial of a vocabulary split)
                    return None
                row.append(o[0])
    need = [tuple(x) for x in moved]
    placed = [tuple(o) if o is not None else None for o in outs]
    tensors = [(s.shape, p) for s, p in zip(given, need, strict=True)]
    tensors += [(tuple(sh), p) for sh, p in zip(out_shapes, placed, strict=True) if p is not None]
    if not all(_even(shape, p, tuple(mesh.shape)) for shape, p in tensors):
        return None
    return need, placed


_PLAIN = (Shard, Replicate, Partial)
_LOOSE = (*_PLAIN, StridedShard)
"""Placements `_per_axis` combines: plain ones; inside `candidates` also DTensor's strided
shards (a mesh dim's strategies take them as its single-dim rules expand them, so the product
of per-dim answers is still one of the full mesh's strategies)."""


def _axis(s: Spec, m: int) -> Spec:
    return Spec((s.placements[m],), s.shape, s.stride, s.dtype)


def _even(shape: Sequence[int], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """Whether every dim that `placements` split divides evenly into at least one element."""
    for d, size in enumerate(shape):
        n = 1
        for p, axis in zip(placements, mesh_shape, strict=True):
            if isinstance(p, Shard) and p.dim % max(len(shape), 1) == d:
                n *= axis
        if n > 1 and (size < n or size % n):
            return False
    return True
