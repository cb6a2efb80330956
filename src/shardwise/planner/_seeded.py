"""Seeded backward: which AllReduces' adjoints are local when ``loss.backward()`` starts with
no gradient argument (`plan_seeded`, after `_backward.plan_backward`).

A backward without a gradient starts from a seed of ones, the same on every rank. Its gradient
stays the same on every rank through ops that run alike on every rank: every input and output
whole (no split dim, no partial axis), no collective, no gradient average, no random draw, not
in place. Call such a node *whole*, and *tail* a whole node whose every consumer is a tail node
or the step's return: a gradient reaching a tail node can only come from the seed through other
tail nodes, so it is the same on every rank. An AllReduce that makes a partial value whole
(``loss.mean()`` over split rows, made whole before ``loss / accumulation_steps``) whose every
consumer is a tail node (or the return) then gets a gradient that is the same on every rank:
its adjoint is that gradient times the group size, computed locally, instead of an AllReduce
(`communication.sum_over_ranks` with ``seeded``, while `replicated_seed` runs the backward).
A backward with an explicit gradient, or through ``torch.autograd.grad``, is not seeded: the
adjoint stays an AllReduce.

`plan_deferred` (after `plan_seeded`): a seeded edge of a weighted mean loss (`_losses`: the
AllReduce of the pair (loss x counted, counted)) whose backward need not wait for the summed
count. Its backward divides by an estimate of it instead (this rank's count times the group
size, which is the sum when every rank counted alike), and the gradient buckets multiply each
rank's gradients by estimate / sum before summing them (`parallel/_grad_buckets.GradBuckets`). That
is exact when no other collective meets the gradients before their buckets: the loss's AllReduce
is the plan's only collective. A gradient that reaches a parameter other than through the loss
(``loss + 0.01 * l2``) then comes from values whole on every rank, the same share on each, and
the factors add up to the group size over its ranks: the buckets' sum leaves it unchanged.

`root_collectives` (read by the reports and `step_cost`): an op's own AllReduce (sum or mean)
that makes a value the train step's backward starts from (``sw.ops.ReduceMean`` returning the
loss), returned as it comes out of the op, is the root's ``grad_fn`` itself: its adjoint is the
seed times the group size, computed locally (`replicated_seed`), so backward sends nothing there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardwise.planner._draws import ATTENTION_DROPOUT, GLOBAL_DRAWS
from shardwise.planner._graph import Graph, Ref
from shardwise.planner._in_place import writes_input
from shardwise.planner._losses import WEIGHTED_MEAN
from shardwise.planner._plan import EdgePlan, NodePlan, ParallelPlan, Placed

_QUIET = {"", "random", ATTENTION_DROPOUT, GLOBAL_DRAWS}
"""`NodePlan.local` computations that run on this rank's blocks alone (`plan_deferred`)."""


def _whole(p: Placed) -> bool:
    m = p.layout.matrix
    return not any(m.shape[a] > 1 for a in (*p.layout.used_axes(), *p.partial))


def plan_seeded(
    graph: Graph, nodes: Sequence[NodePlan], edges: Sequence[EdgePlan]
) -> tuple[EdgePlan, ...]:
    """`edges` with ``seeded`` set on each AllReduce of a partial value whose every consumer is
    a tail node or the return (see the module docstring).

    Example:
        >>> [e.value for e in plan_seeded(graph, nodes, edges) if e.seeded]  # doctest: +SKIP
        ['%93']
    """
    consumers: dict[str, set[int]] = {}
    for node in graph.nodes:
        for ref in node.inputs:
            consumers.setdefault(str(ref), set()).add(node.index)
    for ref in graph.outputs:
        consumers.setdefault(str(ref), set()).add(-1)
    tail: set[int] = {-1}
    for n in reversed(nodes):  # (consumers run after their producers)
        whole = all(_whole(p) for p in (*n.inputs, *n.outputs))
        alike = not (n.comms or n.backward or n.draws or n.local)
        outs = [str(Ref("node", n.index, o)) for o in range(len(n.outputs))]
        read = [consumers.get(v, set()) for v in outs]
        if (
            whole
            and alike
            and not writes_input(graph.nodes[n.index])
            and all(c <= tail for c in read)
        ):
            tail.add(n.index)

    def seeded(e: EdgePlan) -> bool:
        read = consumers.get(e.value)
        return bool(e.reduced) and read is not None and read <= tail

    return tuple(dataclasses.replace(e, seeded=True) if seeded(e) else e for e in edges)


def plan_deferred(nodes: Sequence[NodePlan], edges: Sequence[EdgePlan]) -> tuple[EdgePlan, ...]:
    """`edges` with ``deferred`` set on the seeded AllReduce of a weighted mean loss when it is
    the plan's only collective (see the module docstring): no other edge moves a value, no node
    has a collective or a gradient average of its own, and no node's local compute talks to
    other ranks (a split batch norm gathers its statistics).

    Example:
        >>> [e.value for e in plan_deferred(nodes, edges) if e.deferred]  # doctest: +SKIP
        ['%93']
    """
    moving = [e for e in edges if not e.shared and (e.reduced or e.steps or e.written_back)]
    ran = [c for n in nodes for c in n.comms if not c.block]  # (not a batch norm's own)
    if len(moving) != 1 or ran or any(n.backward for n in nodes):
        return tuple(edges)
    (loss,) = moving
    producer = int(loss.value[1:].split(".")[0]) if loss.value.startswith("%") else -1
    if not (loss.seeded and not loss.kept and producer >= 0):
        return tuple(edges)
    if nodes[producer].local != WEIGHTED_MEAN:
        return tuple(edges)
    if any(n.local not in _QUIET for n in nodes if n.index != producer):
        return tuple(edges)
    return tuple(dataclasses.replace(e, deferred=True) if e is loss else e for e in edges)


def root_collectives(plan: ParallelPlan) -> set[tuple[int, int]]:
    """(node index, position in its `NodePlan.comms`) of each op's own AllReduce whose adjoint
    ``loss.backward()`` runs locally: the last collective the executor runs on an output that
    is a backward root (`ParallelPlan.roots`), an AllReduce by sum or mean (a maximum's adjoint
    all-reduces), returned unmoved (see the module docstring).

    Example:
        >>> root_collectives(plan)  # a loss made whole by sw.ops.ReduceMean, node 2
        {(2, 0)}
    """
    roots = {r.value for r in plan.roots}
    moved = {e.value for e in plan.edges if e.consumer == -1 and (e.reduced or e.steps or e.kept)}
    out: set[tuple[int, int]] = set()
    for n in plan.nodes:
        last: dict[int, int] = {}  # output -> its last collective run on it
        for i, c in enumerate(n.comms):
            if not c.block:
                last[c.output] = i
        for output, i in last.items():
            value = str(Ref("node", n.index, output))
            summed = n.comms[i].kind == "AllReduce" and n.comms[i].detail != "max"
            if summed and value in roots and value not in moved:  # (`runtime.combine`)
                out.add((n.index, i))
    return out
