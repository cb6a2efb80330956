"""The errors of following an op's aten program (`_follow._Follow`), and their messages.

- `FollowErrors._check_layouts`: every input's and output's placements must be a `TensorLayout`
  of its global shape, else `NoLayout` (DTensor's view rules give placements no layout holds:
  a reshape merging dims split on different axes, the outer one not split whole).
- `FollowErrors._error`: the `PlanError` (or `NeedsWholeDim`) for an aten op no rule can run on
  the inputs as placed, naming the op, its shapes and placements and the fix (`_uneven_fix`: a
  view cutting a split dim into groups its parts do not divide; a rule failing by a fault of
  its own, ``KeyError: 2``: `_internal`, named as such with a fix that holds).
- `RandomFillError`, `NeedsWholeDim`, `NoLayout`: what `_Follow._cheaper` answers with another
  strategy.
"""

from __future__ import annotations

import functools
from typing import Any

from shardwise._torch.dtensor import StridedShard
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.planner._graph import Graph, Node, Ref
from shardwise.planner._in_place import in_place
from shardwise.planner._placement import Placements, PlanError, to_placed
from shardwise.planner._plan import Placed


class RandomFillError(PlanError):
    """No sharding rule runs an op's random fill on its inputs as placed (``bernoulli_`` on a
    partial sum): `_Follow._cheaper` then tries the data-parallel strategy."""


class NeedsWholeDim(PlanError):
    """No sharding rule runs an op on a dim its input has split, and its rule does not ask to
    redistribute it (DTensor's ``unbind`` of a split dim; a view merging a dim split on one axis
    with a dim split on another, which it "requires redistribution" for): `_Follow._cheaper`
    then makes its inputs' splits whole in turn, then tries the data-parallel strategy."""


class NoLayout(PlanError):
    """An op's rule places an input or output so that no `TensorLayout` of its shape holds it
    (`_Follow._check_layouts`): `_Follow._cheaper` then makes its inputs' splits whole in
    turn, then tries the data-parallel strategy; the automatic planners skip the candidate."""


@functools.lru_cache(maxsize=1 << 16)
def _check(layout: TensorLayout, shape: tuple[int, ...]) -> None:
    """`layout.check(shape)`, once per layout and shape (planning asks the same few thousands of
    times)."""
    layout.check(shape)


class FollowErrors:
    """The error half of `_follow._Follow` (which sets the attributes below)."""

    graph: Graph
    matrix: DeviceMatrix
    device_num: int
    state: dict[Ref, Placed]

    def _check_layouts(self, node: Node, need: list[Placements], outs: list[Placements]) -> None:
        """Raise `NoLayout` when an input's or output's placements are no `TensorLayout` of its
        global shape: the plan places and moves values as layouts only. DTensor's view rules
        give such placements: a reshape merging dims split on different axes, the outer one
        not split whole (``Shard`` then ``_StridedShard`` on one dim: each rank's elements are
        not its block of every group), or a view of a strided dim into a dim that holds fewer
        elements than its groups times its split (DTensor splits it unevenly)."""
        every = [*need, *outs]
        if not any(isinstance(p, StridedShard) for placements in every for p in placements):
            return  # (plain splits: always a layout; their evenness is checked apart)
        infos = [self.graph.info(r) for r in node.inputs] + list(node.outputs)
        for placements, info in zip(every, infos, strict=True):
            try:
                _check(to_placed(self.matrix, placements, len(info.shape)).layout, info.shape)
            except ValueError as e:
                raise NoLayout(
                    f"{node.name} ({node.op} at {node.source}): its sharding rule, with inputs "
                    f"placed {need}, places a tensor of global shape {list(info.shape)} as "
                    f"{placements}, which no layout on {self.matrix} holds ({e}). Fix: make "
                    f"whole (sw.reshard) all but one of the splits of the dims the op merges or "
                    f"splits, or annotate the op with shard()"
                ) from None

    def _error(self, node: Node, op: Any, e: BaseException) -> PlanError:
        shapes = [list(self.graph.info(r).shape) for r in node.inputs]
        placed = [str(self.state.get(r, "(a candidate placement)")) for r in node.inputs]
        whole, why = False, str(e).rstrip(".")
        if _internal(e):  # (a rule's own fault: ``KeyError: 2``, whose message is "2")
            why = f"its sharding rule failed on them ({type(e).__name__}: {e})"
            split = any(
                (p := self.state.get(r)) is not None and p.spread() > 1 for r in node.inputs
            )
            whole_fix = "make the op's split inputs whole before it (x = sw.reshard(x, (1,) * "
            fix = (whole_fix + "x.dim())), or " if split else "") + (
                "annotate the op with shard(); the rule's failure is a bug, please report it"
            )
        elif "in-place" in str(e) or in_place(node.op):
            fix = _in_place_fix(node.op)
        elif "evenly" in str(e):  # (a view cutting a split dim into groups it does not divide)
            fix = self._uneven_fix(node)
        elif whole := "without redistribution" in str(e):  # (DTensor's ``unbind`` of it)
            fix = (
                "the op needs whole a dim that its input has split, also with the data-parallel "
                "strategy: take the parts another way (x.chunk(n, dim) or indexing for "
                "x.unbind(dim)), or make that dim whole before the op (sw.reshard)"
            )
        elif whole := "requires redistribution" in str(e):  # (a view merging split dims)
            fix = (
                f"the op reshapes a dim its input has split together with another split dim, "
                f"also with the data-parallel strategy: make one of them whole before the op "
                f"(sw.reshard), or use a global batch divisible by {self.device_num}"
            )
        else:
            fix = (
                f"make the split dims divisible by the number of devices splitting them (e.g. "
                f"a global batch divisible by {self.device_num}), or annotate the op with shard()"
            )
        kind = NeedsWholeDim if whole else PlanError
        return kind(
            f"{node.name} ({node.op} at {node.source}): {op} cannot run on inputs of global "
            f"shapes {shapes} placed {placed} over {self.device_num} devices: {why}. Fix: {fix}"
        )

    def _uneven_fix(self, node: Node) -> str:
        """The fix for a view that cuts a split dim unevenly, naming the split dims and the
        nodes that made them."""
        dims, producers = [], []
        for i, ref in enumerate(node.inputs):
            placed = self.state.get(ref)
            if placed is None or not placed.layout.used_axes():
                continue
            shape = list(self.graph.info(ref).shape)
            split = [d for d, axes in enumerate(placed.layout.dims) if axes]
            parts = [f"dim {d} split in {placed.layout.split_count(d)}" for d in split]
            dims.append(f"input {i} (global shape {shape}, {', '.join(parts)})")
            if ref.kind == "node":
                producers.append(self.graph.nodes[int(ref.key)].name)
        return uneven_fix_text("; ".join(dims) or "a split dim", producers)


def _internal(e: BaseException) -> bool:
    """Whether a rule's exception is its own fault rather than a refusal with a reason (a
    ``KeyError`` or ``IndexError`` from its indexing, a bare ``assert``)."""
    return isinstance(e, KeyError | IndexError) or (isinstance(e, AssertionError) and not str(e))


def _in_place_fix(op: str) -> str:
    """The fix for an in-place op that would need its input moved: its out-of-place form."""
    if "setitem" in op or "index_put" in op:  # (``x[:, idx] = v``: item assignment)
        return (
            "write it out of place (x = torch.where(mask, v, x) with a boolean mask of the "
            "written places, or x.index_copy(dim, idx, v) / x.scatter(dim, index, v), for "
            "x[..., idx] = v), or make the written dim whole before it (sw.reshard)"
        )
    return "write it out of place (x = F.relu(x) for F.relu(x, inplace=True), x = x + y for x += y)"


def uneven_fix_text(what: str, producers: list[str]) -> str:
    made = f" (made by {', '.join(producers)})" if producers else ""
    return (
        f"the op cuts {what}{made} into groups that its number of parts does not divide (for "
        f"example 2 attention heads over 4 model-parallel ranks, or q, k and v of a fused "
        f"projection viewed as (3, heads, head_dim) over 2): make the groups (heads) "
        f"divisible by it, leave the layer making the split unannotated, or split that "
        f"layer's output strided (sw.strided, docs/layout.md)"
    )
