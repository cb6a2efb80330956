"""Partial values the plan cannot reduce (`aten_rules.decide` asks DTensor again with the
inputs whole on their mesh axes): a plan reduces partial values by sum or mean only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate

from shardwise._torch import pytree
from shardwise.ops._dtensor import Spec

Placements = tuple[Placement, ...]

LOGICAL_OR_OPS = frozenset({"aten.any.default", "aten.any.dim", "aten.any.dims", "aten.any.out"})
"""aten ops whose DTensor rule calls a reduction of a split dim a partial *sum* where the ranks'
blocks combine by logical or (``mask.any(0)`` over split rows: DTensor's bool sum saturates, but
the plan's sum is carried through ``.float()`` or ``.sum()`` and counts the ranks holding True).
`odd_partial_axes` treats such a partial as it treats a max: the op's inputs whole first."""


def odd_partial_axes(outs: Sequence[Placements | None], op: Any = None) -> set[int]:
    """The mesh axes where an output is a partial value the plan cannot reduce: one combined by
    max, min or product, or one of DTensor's partial subclasses (a norm's, a masked lookup's),
    any partial of an op in `LOGICAL_OR_OPS` (a logical or), and, when an output is a sum on
    some axes and a mean on others, the mean's (a `Placed` reduces all its partial axes one
    way)."""
    odd: set[int] = set()
    for placements in outs:
        if placements is None or not any(isinstance(p, Partial) for p in placements):
            continue
        if str(op) in LOGICAL_OR_OPS:
            odd |= {a for a, p in enumerate(placements) if isinstance(p, Partial)}
            continue
        kinds = {
            a: p.reduce_op if type(p) is Partial else "other"
            for a, p in enumerate(placements)
            if isinstance(p, Partial)
        }
        odd |= {a for a, k in kinds.items() if k not in ("sum", "avg")}
        if {"sum", "avg"} <= set(kinds.values()):
            odd |= {a for a, k in kinds.items() if k == "avg"}
    return odd


def whole_on(axes: set[int], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """The arguments with every tensor whole (replicated) on mesh `axes`."""

    def whole(s: Spec) -> Spec:
        placements = tuple(Replicate() if a in axes else p for a, p in enumerate(s.placements))
        return Spec(placements, s.shape, s.stride, s.dtype)

    moved: tuple[Any, Any] = pytree.tree_map_only(Spec, whole, (tuple(args), dict(kwargs)))
    return moved
