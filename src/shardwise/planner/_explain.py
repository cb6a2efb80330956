"""Why an automatic planner chose each op's strategy: the alternatives and their costs.

- `Alternative`: one candidate strategy of an op (its split counts and its inputs' and outputs'
  placements on the matrix's axes, which tell apart candidates whose counts coincide) with its
  cost split into communication (the
  redistributions on the op's edges, its neighbours as chosen, by the cost model), compute
  (elements one rank computes) and memory (bytes of its inputs' and outputs' blocks on one
  rank).
- `Explanation`: an op's chosen strategy, where it came from (annotated, or the annotated op or
  dataset it was propagated from: the nearest one along the graph's edges) and its cheapest
  alternatives.
- `explain_run`: every node's `Explanation` from a solved `_propagate.Propagation`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.layout import DeviceMatrix
from shardwise.planner._choices import Choice
from shardwise.planner._graph import Graph
from shardwise.planner._placement import _itemsize, to_placed
from shardwise.planner._solve import _pair

if TYPE_CHECKING:
    from shardwise.planner._propagate import Propagation

KEPT = 6
"""Alternatives an `Explanation` keeps (the cheapest, the chosen one always among them)."""


@dataclass(frozen=True)
class Alternative:
    """One candidate strategy of an op (see the module docstring)."""

    strategy: tuple[tuple[int, ...], ...]
    comm_s: float
    compute: int
    memory: int
    chosen: bool = False
    compute_s: float | None = None
    placed: str = ""  # (its inputs' and outputs' placements: split counts may coincide)

    def __str__(self) -> str:
        mark = "  <- chosen" if self.chosen else ""
        timed = f" ({self.compute_s * 1e6:.1f} us)" if self.compute_s is not None else ""
        where = f" {self.placed}" if self.placed else ""
        return (
            f"{self.strategy}{where}: comm {self.comm_s * 1e6:.1f} us, compute {self.compute} "
            f"elements{timed}, memory {self.memory} B{mark}"
        )


@dataclass(frozen=True)
class Explanation:
    """Why an op has its strategy.

    Attributes:
        name: the op (module path and op).
        strategy: its in_strategy.
        source: ``"annotated"``, ``"propagated from <op> (annotated)"`` or ``"propagated from
            the dataset strategy (input ...)"``; in the search ``"searched: the least total
            cost, constrained by <op> (annotated)"`` (or by the dataset strategy).
        alternatives: the cheapest candidates (by communication, then compute), with costs.
    """

    name: str
    strategy: tuple[tuple[int, ...], ...]
    source: str
    alternatives: tuple[Alternative, ...]

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.strategy} ({self.source})"]
        lines += [f"    {a}" for a in self.alternatives]
        return "\n".join(lines)


def _strategy(
    graph: Graph, index: int, c: Choice, matrix: DeviceMatrix
) -> tuple[tuple[int, ...], ...]:
    node = graph.nodes[index]
    out = []
    for placed, ref in zip(c.need, node.inputs, strict=True):
        ndim = len(graph.info(ref).shape)
        layout = to_placed(matrix, placed, ndim).layout
        out.append(tuple(layout.split_count(d) for d in range(ndim)))
    return tuple(out)


def _placed(graph: Graph, index: int, c: Choice, matrix: DeviceMatrix) -> str:
    """``[(g0, None), (None, None) -> (g0, None) partial-sum[g1]]``: the choice's inputs' and
    outputs' placements on the matrix's axes."""
    node = graph.nodes[index]
    ins = [len(graph.info(r).shape) for r in node.inputs]
    outs = [len(o.shape) for o in node.outputs]
    text = [str(to_placed(matrix, p, n)) for p, n in zip(c.need, ins, strict=True)]
    made = [str(to_placed(matrix, p, n)) for p, n in zip(c.outs, outs, strict=True)]
    return f"[{', '.join(text)} -> {', '.join(made)}]"


def _memory(graph: Graph, index: int, c: Choice, matrix: DeviceMatrix) -> int:
    node = graph.nodes[index]
    infos = [graph.info(r) for r in node.inputs] + list(node.outputs)
    total = 0
    for placed, info in zip([*c.need, *c.outs], infos, strict=True):
        layout = to_placed(matrix, placed, len(info.shape)).layout
        total += math.prod(layout.local_shape(info.shape)) * _itemsize(info.dtype)
    return total


def explain_run(
    graph: Graph, run: Propagation, mode: str = "sharding_propagation"
) -> dict[str, Explanation]:
    """Every node's `Explanation` from a solved `_propagate.Propagation` `run`, made by `mode`
    (the search's sources say so: its ops are chosen by the total cost, an annotation only
    constrains them)."""
    p, problem, pick = run.setup.planner, run.problem, run.assignment
    var = {key: v for v, key in enumerate(run.variables)}
    nbrs = problem.neighbours()
    fixed = set(run.fixed)
    out: dict[str, Explanation] = {}
    sources = _sources(graph, run, fixed, nbrs)
    if mode != "sharding_propagation":
        sources = [_searched(x) for x in sources]
    shaped: dict[tuple[int, int], tuple[tuple[tuple[int, ...], ...], int, str]] = {}
    for node in graph.nodes:
        sig = run.choices.signature_id(node)
        v = var[("node", node.index)]
        choices = run.choices.nodes[node.index]
        alts = []
        for j, c in enumerate(choices):
            ns = problem.unary[v][j][0] + sum(_pair(problem, v, j, u, pick[u])[0] for u in nbrs[v])
            compute_s = None
            key = (id(c), sig)  # (the same candidate of the same op: repeated layers)
            if key not in shaped:
                shaped[key] = (
                    _strategy(graph, node.index, c, p.matrix),
                    _memory(graph, node.index, c, p.matrix),
                    _placed(graph, node.index, c, p.matrix),
                )
            strategy, memory, placed = shaped[key]
            if problem.parts is not None:  # (the search: compute and memory are in its cost)
                _, compute_ns, memory_ns = problem.parts[v][j]
                ns -= compute_ns + memory_ns
                compute_s = compute_ns / 1e9
            alts.append(
                Alternative(strategy, ns / 1e9, c.compute, memory, j == pick[v], compute_s, placed)
            )
        ranked = sorted(alts, key=lambda a: (_rank(a), a.compute, not a.chosen))[:KEPT]
        chosen = next(a for a in alts if a.chosen)
        if chosen not in ranked:
            ranked[-1] = chosen
        source = "annotated" if v in fixed else sources[v]
        out[node.name] = Explanation(node.name, chosen.strategy, source, tuple(ranked))
    return out


def _searched(source: str) -> str:
    """A propagation source as the search's: the least total cost, near what constrained it."""
    near = source.removeprefix("propagated from ")
    if near == source:
        return "searched: the least total cost (no annotation reaches it)"
    return f"searched: the least total cost, constrained by {near}"


def _rank(a: Alternative) -> float:
    """What an alternative is ranked by: its communication (and, in the search, its compute)."""
    return a.comm_s + (a.compute_s or 0.0)


def _sources(graph: Graph, run: Propagation, fixed: set[int], nbrs: list[list[int]]) -> list[str]:
    """Per variable: where its strategy came from. Sources are the annotated ops and the ops
    reading an input that took the strategy the input's placement favours (`_input_decides`);
    a variable takes the source reached over the fewest links that move a value as chosen (a
    strategy handed on without a move is propagated; one search from all sources at once, an
    annotated op first at equal count)."""
    variables, anchored = run.variables, run.problem.anchored
    problem, pick = run.problem, run.assignment
    label: list[str | None] = [None] * len(variables)
    moved: list[float] = [math.inf] * len(variables)
    queue: deque[int] = deque()
    for v in sorted(fixed):
        _, key = variables[v]
        label[v], moved[v] = f"propagated from {graph.nodes[int(key)].name} (annotated)", 0
        queue.append(v)
    for v in sorted(anchored):
        if label[v] is None and _input_decides(run, v):
            label[v], moved[v] = "propagated from the dataset strategy (the inputs' placement)", 0
            queue.append(v)
    while queue:  # (fewest moving links first: a link without a move costs 0)
        v = queue.popleft()
        for u in nbrs[v]:
            step = 1 if any(_pair(problem, v, pick[v], u, pick[u])) else 0
            if moved[v] + step < moved[u]:
                label[u], moved[u] = label[v], moved[v] + step
                if step:
                    queue.append(u)
                else:
                    queue.appendleft(u)
    alone = "no annotation reaches it: the cheapest on its own"
    return [x if x is not None else alone for x in label]


def _input_decides(run: Propagation, v: int) -> bool:
    """Whether variable `v` (an op reading a graph input) took a strategy that moves its inputs
    least from where they arrive: its own cost (the inputs' moves; in the search without
    compute and memory) is the least of its candidates'."""
    problem, j = run.problem, run.assignment[v]

    def moves(k: int) -> float:
        ns = problem.unary[v][k][0]
        if problem.parts is not None:
            ns -= problem.parts[v][k][1] + problem.parts[v][k][2]
        return ns

    return moves(j) <= min(moves(k) for k in range(len(problem.unary[v])))
