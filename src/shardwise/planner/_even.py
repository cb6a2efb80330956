"""A sharding rule's decision whose splits shardwise's equal blocks hold.

- `even_decision`: `ops.aten_rules.decide` for one aten call, its outputs checked even
  (`uneven`). When a rule cuts a partial sum onto a dim its parts do not divide (DTensor's
  ReduceScatter of a row-parallel layer's output onto rows a data-parallel split already
  halved: 6 rows over dp 2 x mp 2 leave 3 rows for 2 model-parallel parts), the partial sum is
  reduced whole instead (an AllReduce: the rule is asked again with it whole on those axes),
  which keeps the rows as they were split before.
- `uneven`: why a rule's output is split into parts its size does not divide.
- `out_meta`: an aten call's outputs' metadata as captured, for DTensor (when it holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.tensor import Partial, Replicate

from shardwise._torch.dtensor import OutMeta
from shardwise.ops import _flat as flat
from shardwise.ops._dtensor import Spec
from shardwise.ops.aten_rules import Decision, decide
from shardwise.planner._graph import AtenArg, AtenCall


def even_decision(
    op: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: Any,
    ndim: int,
    shapes: list[tuple[int, ...]],
    out_meta: Sequence[OutMeta] | None = None,
) -> Decision:
    """`decide`'s `Decision` for aten `op` on `args` / `kwargs` (tensors as `Spec`s), or, when
    its outputs are uneven and it cuts a partial sum into a split, the decision with that
    partial sum reduced whole first (when that one is even). `shapes`: the outputs' global
    shapes; `out_meta`: their shapes, strides and dtypes, when they are known to hold.

    Raises:
        ValueError: an output split unevenly either way (`uneven`'s reason, of the first
            decision); the planner turns it into the op's `PlanError`.
    """
    dec = decide(op, args, kwargs, mesh, ndim, shapes, out_meta)
    why = uneven(dec.outputs, shapes, tuple(mesh.shape))
    if why is None:
        return dec
    given = [s for s in flat.leaves((list(args), dict(kwargs))) if isinstance(s, Spec)]
    cut = _cut_partials(given, dec)
    if cut:
        again = decide(op, *_reduced(cut, args, kwargs), mesh, ndim, shapes, out_meta)
        if uneven(again.outputs, shapes, tuple(mesh.shape)) is None:
            return again
    raise ValueError(why)


def _cut_partials(given: list[Spec], dec: Decision) -> dict[int, set[int]]:
    """``id(spec) -> mesh axes`` where a given tensor is a partial sum that `dec` wants split
    (a ReduceScatter)."""
    cut: dict[int, set[int]] = {}
    for spec, want in zip(given, dec.inputs, strict=False):
        for axis, (have, p) in enumerate(zip(spec.placements, want, strict=False)):
            if isinstance(have, Partial) and getattr(p, "dim", None) is not None:
                cut.setdefault(id(spec), set()).add(axis)
    return cut


def _reduced(
    cut: dict[int, set[int]], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Any, Any]:
    """`args` and `kwargs` with each tensor of `cut` whole on its axes there."""

    def whole(s: Spec) -> Spec:
        axes = cut.get(id(s), set())
        placements = tuple(Replicate() if a in axes else p for a, p in enumerate(s.placements))
        return Spec(placements, s.shape, s.stride, s.dtype)

    moved: tuple[Any, Any] = flat.map_only(Spec, whole, (list(args), dict(kwargs)))
    return moved


def uneven(outputs: Any, shapes: list[tuple[int, ...]], mesh: tuple[int, ...]) -> str | None:
    """Why a rule's output splits a dim into parts its size does not divide (DTensor checks
    each mesh dim alone: 4 rows over (2, 4) pass it; shardwise's blocks are equal), or None.
    Raised as ValueError, it becomes the op's PlanError with the uneven-view fix; `_cheaper`
    then tries its fallbacks (each dim over its outer axis only), which run the op where one
    fits."""
    for placed, shape in zip(outputs, shapes, strict=False):
        if placed is None:
            continue
        parts = [1] * len(shape)
        for size, p in zip(mesh, placed, strict=False):
            dim = getattr(p, "dim", None)
            if dim is not None and dim < len(shape):
                parts[dim] *= size
        for d, (size, n) in enumerate(zip(shape, parts, strict=True)):
            if size % n:
                return (
                    f"output dimension {d} (size {size}) is not evenly divisible by its {n} parts"
                )
    return None


def out_meta(call: AtenCall, args: list[AtenArg]) -> list[OutMeta] | None:
    """`call`'s outputs' metadata as captured, or None when an output is one of its inputs (an
    in-place op such as ``t_`` may have changed that tensor's shape since it was recorded)."""
    given = {id(a) for a in args}
    if any(o.kind == "in" or id(o) in given for o in call.outputs):
        return None
    return [(o.info.shape, o.stride, o.info.dtype) for o in call.outputs]
