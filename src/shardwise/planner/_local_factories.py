"""Fills made as this rank's block: a ``torch.zeros`` every consumer reads split (`split_fills`).

A factory (an op without tensor inputs) is planned whole on every rank, and each consumer that
wants it split cuts its block (a `Slice`: no communication). For a fill of one value
(``torch.zeros`` / ``ones`` / ``empty`` / ``full``, `FILLS`) whose every consumer cuts the same
block, the plan makes it as that block instead: the edges go, and the factory runs with its
local sizes (`NodePlan.local_shapes`). Besides the copy it saves, the tensor then has the shape
the network's own code expects: a recurrent layer's initial state ``torch.zeros(layers,
x.size(0), hidden)``, checked against this rank's batch before the op runs (``nn.GRU``'s
``check_hidden_size``), is this rank's rows, as ``x`` is. A fill that item assignment changes
while the plan would move it for that (FNO's ``out = torch.zeros(b, C, M); out[:, :, :k] =
...`` with ``b`` this rank's rows) is made as the block there (`split_fill`): a moved copy
would take the change instead of the tensor later ops read.

`split_fills(graph, nodes, edges)` returns the nodes and edges with such fills placed split;
`split_fill` decides it for one fill that an op changes in place, while planning;
`fill_shape` reads the shape a fill's call asks for, a factory's (`FILLS`) or a tensor
method's (``x.new_ones(b, 1)``, `NEW_FILLS`: planned as an op on ``x``, not placed here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shardwise.planner._graph import Graph, Ref
from shardwise.planner._placement import _itemsize
from shardwise.planner._plan import EdgePlan, NodePlan, Placed
from shardwise.redistribution import Slice, plan_redistribution

FILLS = frozenset({"torch.zeros", "torch.ones", "torch.empty", "torch.full"})
"""Factories of one value everywhere: any block of them is the same op at the block's sizes."""

NEW_FILLS = frozenset(
    {"torch.Tensor.new_ones", "torch.Tensor.new_zeros", "torch.Tensor.new_full"}
    | {"torch.Tensor.new_empty"}
)
"""The same fills made as a tensor's method (its dtype and device; sizes from the call)."""


def split_fills(
    graph: Graph, nodes: Sequence[NodePlan], edges: Sequence[EdgePlan]
) -> tuple[tuple[NodePlan, ...], tuple[EdgePlan, ...]]:
    """`nodes` and `edges` with every fill whose consumers all cut one block made as it."""
    consumers = graph.consumers()
    returned = set(graph.outputs) | set(graph.roots)
    by_value: dict[str, list[EdgePlan]] = {}
    for e in edges:
        by_value.setdefault(e.value, []).append(e)
    out_nodes, dropped = list(nodes), set()
    for n in nodes:
        ref = Ref("node", n.index, 0)
        if n.op not in FILLS or n.inputs or len(n.outputs) != 1 or ref in returned:
            continue
        reads = consumers.get(ref, [])
        moves = {(e.consumer, e.slot): e for e in by_value.get(str(ref), []) if e.consumer >= 0}
        if not reads or any(r not in moves for r in reads) or len(moves) != len(reads):
            continue
        dst = {e.dst for e in moves.values()}
        first = next(iter(moves.values()))
        if (
            len(dst) != 1
            or first.src != n.outputs[0]
            or first.src.partial
            or first.dst.partial
            or not all(isinstance(s, Slice) for e in moves.values() for s in e.steps)
        ):
            continue
        out_nodes[n.index] = dataclasses.replace(n, outputs=(first.dst,))
        dropped |= {id(e) for e in moves.values()}
    return tuple(out_nodes), tuple(e for e in edges if id(e) not in dropped)


def split_fill(
    graph: Graph, ref: Ref, src: Placed, dst: Placed, edges: Sequence[EdgePlan], at: int
) -> list[EdgePlan] | None:
    """`edges` less the moves of fill `ref` (placed `src`) when node `at`, which changes it in
    place (item assignment: FNO's ``out[:, :, :k] = ...`` on ``torch.zeros(b, C, M)``), may
    have it made as block `dst` instead of moving it: `dst` is a block of it (`Slice` steps
    only, nothing partial), it is not returned, and every earlier read cut that block; else
    None. The change then lands in the fill itself, and later reads get it from there."""
    if ref.kind != "node" or ref.index != 0 or ref in graph.outputs or ref in graph.roots:
        return None
    fill = graph.nodes[int(ref.key)]
    if fill.op not in FILLS or fill.inputs or len(fill.outputs) != 1:
        return None
    info = graph.info(ref)
    steps = plan_redistribution(src.layout, dst.layout, info.shape, _itemsize(info.dtype)).steps
    if src.partial or dst.partial or not all(isinstance(s, Slice) for s in steps):
        return None
    reads = {r for r in graph.consumers().get(ref, []) if r[0] < at}
    cuts = [e for e in edges if e.value == str(ref) and (e.consumer, e.slot) in reads]
    if {(e.consumer, e.slot) for e in cuts} != reads or any(e.dst != dst for e in cuts):
        return None
    return [e for e in edges if not any(e is c for c in cuts)]


def fill_shape(op: str, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape a call of fill `op` asks for (``torch.ones(b, 1)``, ``torch.zeros((b, 1))``,
    ``torch.full((b, 1), 0.9)``, ``size=``, ``x.new_ones(b, 1)``, ``x.new_full((b, 1), 0.9)``),
    or None for another op or one not read.

    Example:
        >>> fill_shape("torch.full", ((4, 1), 0.9), {})
        (4, 1)
        >>> fill_shape("torch.Tensor.new_zeros", (x, 4, 1), {})
        (4, 1)
    """
    if op in NEW_FILLS:
        op, args = op.replace("torch.Tensor.new_", "torch."), args[1:]  # (``x``: not a size)
    elif op not in FILLS:
        return None
    if "size" in kw:
        size = kw["size"]
    elif op == "torch.full" or (len(args) == 1 and not isinstance(args[0], int)):
        size = args[0] if args else ()
    else:
        size = args
    try:
        return tuple(int(s) for s in size)
    except (TypeError, ValueError):
        return None
