"""Checks of a loaded operator strategy file against itself and this network's plan, for
`_files.check_decisions` (called after `_files.check_matches`): `first_inconsistency`.

A file edited by hand (a collective deleted, a redistribution step deleted, a placement
changed without its edges) or written by another shardwise version would otherwise run, or
print, something else than it says:

- `_check_flow`: every op's input placements are where the plan leaves each value (its
  producer's output, the job's input or a parameter's storage) after that input's edge, and
  every edge starts where the value is;
- `_check_steps`: every edge takes the steps `plan_redistribution` gives for its two placements;
- `_check_like_fresh`: an op the file places as this network's own plan does runs the same
  collectives and local compute (a file of another network's annotations, or of a propagated
  or searched plan, places others its own way: those are checked by the flow).
"""

from __future__ import annotations

import dataclasses

from shardwise.planner._placed import Placed, replicated
from shardwise.planner._placement import _itemsize
from shardwise.planner._plan import EdgePlan, NodePlan, ParallelPlan
from shardwise.planner._plan_diff import node_field
from shardwise.redistribution import plan_redistribution


class _Refused(ValueError):
    """The first mismatch found."""


def first_inconsistency(loaded: ParallelPlan, fresh: ParallelPlan) -> str | None:
    """The first way the file's plan `loaded` is not consistent with itself or runs an op placed
    as this network's plan `fresh` places it otherwise (None: none; see the module docstring)."""
    try:
        _check_flow(loaded)
        _check_steps(loaded)
        _check_like_fresh(loaded, fresh)
    except _Refused as e:
        return str(e)
    return None


def _check_flow(plan: ParallelPlan) -> None:
    state: dict[str, Placed] = {f"input:{k}": p for k, p in plan.inputs.items()}
    state |= {f"param:{n}": Placed(p.layout) for n, p in plan.params.items()}
    into: dict[tuple[int, int], EdgePlan] = {}
    after: dict[str, EdgePlan] = {}  # (values made whole where they are made: a loss)
    for e in plan.edges:
        if e.consumer == -2:
            _starts_where(e, state)
            state[e.value] = e.dst
        elif e.consumer == -1:
            after[e.value] = e
        elif not e.written_back:
            into[(e.consumer, e.slot)] = e
    for node in plan.nodes:
        for slot, (value, want) in enumerate(zip(node.values, node.inputs, strict=False)):
            have = state.get(value)
            if have is None and value.split(":", 1)[0] in ("buffer", "const") and node.in_shapes:
                have = replicated(plan.matrix, len(node.in_shapes[slot]))
            edge = into.get((node.index, slot))
            if edge is not None:
                _starts_where(edge, state)
            made = edge.dst if edge is not None else have
            if made is not None and made != want:
                how = "the edge into it makes" if edge is not None else "no edge moves it from"
                raise _Refused(
                    f"op %{node.index} {node.name} takes input {slot} ({value}) as {want}, but "
                    f"{how} {made}"
                )
        for j, placed in enumerate(node.outputs):
            ref = f"%{node.index}" + (f".{j}" if j else "")
            state[ref] = placed
            if ref in after:
                _starts_where(after[ref], state)
                state[ref] = after[ref].dst


def _starts_where(edge: EdgePlan, state: dict[str, Placed]) -> None:
    have = state.get(edge.value)
    if have is not None and edge.src != have:
        raise _Refused(f"the edge {edge} starts from {edge.src}, but {edge.value} is {have}")


def _check_steps(plan: ParallelPlan) -> None:
    for e in plan.edges:
        steps = plan_redistribution(e.src.layout, e.dst.layout, e.shape, _itemsize(e.dtype))
        if tuple(e.steps) != tuple(steps.steps):
            m = e.src.layout.matrix
            said = "; ".join(s.describe(m) for s in e.steps) or "no step"
            need = "; ".join(s.describe(m) for s in steps.steps) or "no step"
            raise _Refused(
                f"the edge moving {e.value} from {e.src} to {e.dst} takes {said}, but those "
                f"placements need {need}"
            )


def _check_like_fresh(loaded: ParallelPlan, fresh: ParallelPlan) -> None:
    planned = {m.index: m for m in fresh.nodes}
    # (which adjoints are local is decided for the whole plan, `_backward`: a plan placing
    # other ops otherwise may make them on other ops; its own comms are compared without them)
    same_equal = _equalised(loaded) == _equalised(fresh)
    for n in loaded.nodes:
        m = planned.get(n.index)
        if m is None or (n.op, n.inputs, n.outputs) != (m.op, m.inputs, m.outputs):
            continue
        if not same_equal:
            n, m = _unequalised(n), _unequalised(m)
        for field in ("comms", "local", "draws", "dtypes", "shapes"):
            if field in ("draws", "dtypes") and not getattr(n, field):
                continue  # (a file saved before plans recorded them: read as the op's)
            if getattr(n, field) != getattr(m, field):
                raise _Refused(
                    f"op %{n.index} {n.name} is placed as this network places it but its "
                    f"{field} differ (file -> this network): {node_field(n, field)} -> "
                    f"{node_field(m, field)}"
                )


def _equalised(plan: ParallelPlan) -> tuple[object, ...]:
    """`plan`'s equal-gradient decisions (`_backward`): its equal parameter gradients and each
    op's ``f``s."""
    return (dict(plan.equal_grads), tuple(n.backward for n in plan.nodes))


def _unequalised(node: NodePlan) -> NodePlan:
    """`node` with no collective's adjoint made local (`Collective.equal_grad`)."""
    comms = tuple(dataclasses.replace(c, equal_grad=()) for c in node.comms)
    return dataclasses.replace(node, comms=comms)
