"""Custom ``torch.autograd.Function``s: found at capture, kept free of collectives by the plan.

Capture records the torch ops a Function's ``forward`` runs like any others, but the backward
that runs is the Function's own, which the plan cannot see: it runs on this rank's blocks as
the forward saw them. That equals one device's exactly when the forward ran on those blocks as
an independent op: no collective and no redistribution inside it. Before and after it the
plan may move and reduce values freely (those collectives are autograd-aware), so a
Function on data-parallel rows, or one whose output is a partial sum reduced after it,
trains like one device.

- `function_of` (capture): the Function whose forward runs the op being recorded (torch's
  ``Function.apply`` frame on the call stack: `_torch.function_apply`), every op of it, however
  deep, and none of a ``no_grad`` block before it.
- `check_functions` (planning): a `PlanError` naming the Function, the op, its source line, the
  collective and the fix when the plan puts a collective or a redistribution inside one.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise._torch.function_apply import running_function
from shardwise.planner._graph import Graph, Node
from shardwise.planner._placed import Collective
from shardwise.planner._placement import PlanError
from shardwise.planner._plan import EdgePlan, NodePlan


def function_of() -> str:
    """The name of the custom autograd Function whose ``forward`` runs the op being recorded
    (the innermost; torch's reentrant checkpoint and shardwise's own Functions passed over,
    their backward replays the plan); empty outside any.

    Example:
        >>> function_of()
        ''
    """
    cls = running_function(_planned_backward)
    return cls.__name__ if cls is not None else ""


def _planned_backward(cls: type) -> bool:
    """Functions whose backward the plan runs itself: torch's reentrant checkpoint
    (`parallel/_recompute.py` replays the region) and shardwise's own."""
    module = getattr(cls, "__module__", "") or ""
    return module == "torch.utils.checkpoint" or module.startswith("shardwise.")


def _inside(node: Node, edge: EdgePlan | None, comms: Sequence[Collective]) -> str:
    """What the plan runs inside the Function at `node` (empty: nothing)."""
    if comms:
        return str(comms[0])
    if edge is None:
        return ""
    where = f"{node.name} input {edge.slot}"
    moved = edge.collectives(where)
    if moved:
        return str(moved[0])
    if edge.steps or edge.kept:
        return f"{edge.value} {edge.src} -> {edge.dst} (a local cut) at {where}"
    return ""


def check_functions(graph: Graph, nodes: Sequence[NodePlan], edges: Sequence[EdgePlan]) -> None:
    """Refuse a plan that runs a collective or moves a value inside a custom autograd
    Function's forward (`graph` marks its nodes: `Node.function`).

    Raises:
        PlanError: naming the Function, the op, its line, what the plan runs there and the fix.

    Example:
        >>> check_functions(graph, plan_nodes, plan_edges)  # doctest: +SKIP
    """
    inside = {n.index for n in graph.nodes if n.function}
    if not inside:
        return
    moved: dict[int, list[EdgePlan]] = {}
    for e in edges:
        if e.consumer in inside and not e.shared:
            moved.setdefault(e.consumer, []).append(e)
    for plan in nodes:
        if plan.index not in inside:
            continue
        node = graph.nodes[plan.index]
        found = [_inside(node, None, plan.comms)]
        found += [_inside(node, e, ()) for e in moved.get(plan.index, [])]
        what = next((w for w in found if w), "")
        if what:
            raise PlanError(
                f"custom autograd.Function {node.function}: the plan runs {what}, inside its "
                f"forward ({node.op} at {node.source}), but its own backward runs on this "
                f"rank's blocks without it and would give wrong gradients. Keep the dims it "
                f"reduces or reshapes whole where it is called (sw.reshard its inputs, or "
                f"annotate the ops before it so that they arrive so), or write it with torch "
                f"ops, which are planned with their gradients"
            )
