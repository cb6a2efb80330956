"""The values of a node's aten program while `_follow._Follow` runs it on placements.

- `Values`: the placements the program's values have so far, by ``(kind, index)`` of their
  `AtenArg`: its intermediates (``("tmp", k)``), and its inputs whose metadata an in-place op
  changed (``("in", i)``: ``squeeze_`` moves the split of a dim to the one before).
- `now`: a value's placements at this point of the program (an input's not in `Values`: those
  it is given; an intermediate's not yet made: whole).
- `copied`: the input of a call whose one output is a same-shaped copy of it, placed alike.
- `lookup`: ``AtenArg -> Spec`` for `flat.map_only`.
"""

from __future__ import annotations

from typing import Any

from shardwise.ops._dtensor import Spec
from shardwise.planner._graph import AtenArg, AtenCall
from shardwise.planner._placement import Placements

Values = dict[tuple[str, int], Placements]


def now(x: AtenArg, need: list[Placements], values: Values, whole: Placements) -> Placements:
    """The placements `x` has now: from `values` (an intermediate, or an input an in-place op
    changed the metadata of), else an input's `need`, else `whole` (an intermediate not made
    by the program: autograd's view of another node's value, run again by an in-place op on
    the view)."""
    if x.kind == "in":
        return values.get(("in", x.index), need[x.index])
    return values.get(("tmp", x.index), whole)


def copied(args: list[AtenArg], call: AtenCall, ins: Any, outs: Any) -> AtenArg | None:
    """The one tensor argument of `call` (besides 0-d ones: scalars) when its one output is a
    same-shaped copy of it, placed as it is, else None: a dtype cast (``_to_copy``), or
    SDPA's boolean mask made additive (``where(mask, 0., -inf)``: its scalars are 0-d)."""
    if len(call.outputs) != 1 or not ins or not outs:
        return None
    wide = [(j, a) for j, a in enumerate(args) if a.info.shape != ()]
    if len(wide) != 1 or len(ins) != len(args):
        return None
    j, arg = wide[0]
    same = call.outputs[0].info.shape == arg.info.shape and outs[0] == ins[j]
    return arg if same else None


def lookup(specs: dict[int, Spec]) -> Any:
    """``arg -> its Spec`` for `flat.map_only`."""

    def find(x: AtenArg) -> Spec:
        return specs[id(x)]

    return find
