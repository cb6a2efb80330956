"""Repeated layers share one decision: tying the variables of identical layers.

A transformer repeats one block: ``transformer.h.0.attn.c_attn/linear`` ...
``transformer.h.11.attn.c_attn/linear`` are the same op on the same shapes, with the same
candidates. The automatic planners tie such variables (the same candidate for all), so the
problem they solve has one variable per tied group and its size does not grow with depth.

- `layer_keys`: the tie key of every variable of a `_propagate.Propagation`-style problem: a
  node's name, or a parameter's, with every numeric module-path component replaced by ``*``
  (``transformer.h.*.attn.c_attn/linear``), plus what its candidates depend on (the node's
  signature, the parameter's shape) and the candidates themselves (by identity: `Choices`
  keeps one object per distinct candidate); None (never tied) for a name with no numeric
  component.
- `tie`: the tied `Problem`: one variable per group of equal keys (its first member
  represents it), each group's unary costs and memory summed over its members; a pair of
  linked variables becomes a pair of their groups (matrices of pairs that land on the same two
  groups are added up), and a pair inside one group (a layer's op linked to the same op of the
  next layer) adds its diagonal to the group's unary cost: only equal candidates are possible.
- `untie`: the tied solution as one candidate per original variable.

Exact for the tied problem: the tied problem's cost of an assignment is the original
problem's cost of the same assignment given to every member, term by term, so `_solve.solve`'s
optimum of the tied problem is the cheapest plan in which repeated layers decide alike. (A plan
in which layers differ is not considered; the first or last layer differs when its candidates
do, since candidates are part of the key.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from shardwise.planner._choices import Choices
from shardwise.planner._graph import Graph
from shardwise.planner._solve import Cost, Matrix, Problem, solve

_INDEX = re.compile(r"(?<=\.)\d+(?=[./]|$)|^\d+(?=[./])")


def _pattern(name: str) -> str | None:
    """`name` with its numeric module-path components as ``*``; None when it has none."""
    out, n = _INDEX.subn("*", name)
    return out if n else None


def layer_keys(
    graph: Graph, choices: Choices, variables: Sequence[tuple[str, int | str]]
) -> list[object | None]:
    """The tie key of each variable (see the module docstring)."""
    keys: list[object | None] = []
    for kind, key in variables:
        if kind == "node":
            node = graph.nodes[int(key)]
            pattern = _pattern(node.name)
            # (candidates are canonical objects, `Choices._canon`: equal ones are the same)
            own: object = (choices.signature_id(node), tuple(map(id, choices.nodes[node.index])))
        else:
            pattern = _pattern(str(key))
            own = (graph.params[str(key)], tuple(map(id, choices.params[str(key)])))
        keys.append(None if pattern is None else (kind, pattern, own))
    return keys


def tie(problem: Problem, keys: Sequence[object | None]) -> tuple[Problem, list[int]]:
    """(the tied problem, each original variable's group); see the module docstring."""
    group: list[int] = []
    seen: dict[object, int] = {}
    members: list[list[int]] = []
    for v, key in enumerate(keys):
        g = seen.setdefault(key, len(members)) if key is not None else len(members)
        if g == len(members):
            members.append([])
        members[g].append(v)
        group.append(g)
    domains = [problem.domains[m[0]] for m in members]
    unary = [
        _tuples(np.asarray([problem.unary[v] for v in m], dtype=np.int64).sum(axis=0))
        for m in members
    ]
    tied = Problem(domains, unary, width=problem.width, cap=problem.cap)
    tied.anchored = {group[v] for v in problem.anchored}
    if problem.memory is not None:
        memory = problem.memory
        tied.memory = [
            [sum(memory[v][i] for v in m) for i in range(domains[g])] for g, m in enumerate(members)
        ]
    if problem.peak is not None:  # (the largest transient of the group's members)
        peak = problem.peak
        tied.peak = [
            [max(peak[v][i] for v in m) for i in range(domains[g])] for g, m in enumerate(members)
        ]
    # (pairs that land on the same two groups are added up; repeated layers repeat the same
    # matrix objects, so each distinct one is converted once and counted)
    landed: dict[tuple[int, int], dict[int, tuple[Matrix, bool, list[int]]]] = {}
    for (u, v), matrix in problem.pairs.items():
        gu, gv = group[u], group[v]
        flip = gu > gv
        entry = landed.setdefault((gv, gu) if flip else (gu, gv), {})
        entry.setdefault(id(matrix) * 2 + flip, (matrix, flip, [0]))[2][0] += 1
    for (gu, gv), entries in landed.items():
        summed = sum(
            (
                np.asarray(m, dtype=np.int64).swapaxes(0, 1)
                if flip
                else np.asarray(m, dtype=np.int64)
            )
            * count[0]
            for m, flip, count in entries.values()
        )
        tied.link(gu, gv, [_tuples(row) for row in summed])  # type: ignore[union-attr]
    return tied, group


def _tuples(rows: np.ndarray) -> list[Cost]:
    """A 2-D integer array as a list of `Cost` tuples."""
    return [tuple(r) for r in rows.tolist()]


def untie(assignment: Sequence[int], group: Sequence[int]) -> list[int]:
    """The tied problem's `assignment` as one candidate per original variable."""
    return [assignment[g] for g in group]


def solve_tied(problem: Problem, keys: Sequence[object | None]) -> tuple[list[int], str]:
    """`_solve.solve` of the tied problem, untied: (candidate per variable, the method)."""
    tied, group = tie(problem, keys)
    assignment, how = solve(tied)
    return untie(assignment, group), how
