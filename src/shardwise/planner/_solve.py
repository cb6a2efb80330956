"""Choosing one candidate per variable at the least total cost (the automatic planners' core).

A `Problem` has variables (a node's or a parameter's candidates: ``domains[v]`` of them), a
cost per candidate (`unary`) and a cost per pair of candidates of two linked variables
(`pairs`: a redistribution between a producer's choice and a consumer's). A `Cost` is a tuple
compared lexicographically: the planner's objective first, then its tie-breaks (all
integers, so that equal costs are exactly equal).

- `solve`: exact. A forest of pairs is solved by dynamic programming over each tree
  (`_tree_dp`: min-sum messages from the leaves, then the argmin from the roots); any other
  graph by an integer program through SciPy's HiGHS (`_ilp`: one binary per candidate, one
  continuous variable per candidate pair with the local-polytope marginal constraints, one
  solve per tuple component with a zero optimality gap, each keeping the optimum of the ones
  before, then one for the lowest candidate indices so that ties do not depend on HiGHS).
- `greedy`: MindSpore's propagation, breadth first from the variables that are fixed (one
  candidate) or anchored (linked to a fixed value), each taking the candidate cheapest
  against its decided neighbours; the baseline the exact answer is never worse than.
- `brute_force`: every assignment (tests, small problems).
- `total`: the cost of an assignment.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Cost = tuple[int, ...]
Matrix = list[list[Cost]]


class OverCap(ValueError):
    """No assignment fits the memory cap."""

    def __init__(self, cap: int) -> None:
        super().__init__(f"no assignment fits the memory cap of {cap} bytes")
        self.cap = cap


def add(a: Cost, b: Cost) -> Cost:
    """Elementwise sum of two costs."""
    return tuple(x + y for x, y in zip(a, b, strict=True))


@dataclass
class Problem:
    """Variables with candidate costs and pairwise costs.

    Attributes:
        domains: candidates per variable.
        unary: per variable, per candidate, its own cost.
        pairs: (u, v) with u < v -> matrix[i][j]: the cost of u taking i and v taking j.
        anchored: variables linked to a fixed value (where `greedy` starts, with the fixed
            variables).
        width: components of a `Cost`.
        memory: per variable, per candidate, bytes it holds on a rank (with `cap`).
        peak: per variable, per candidate, bytes of a transient the candidate needs for a
            moment (an optimizer update's temporaries): only the largest of the chosen ones
            counts against `cap`, with `memory`'s sum (None: none).
        cap: the most bytes the chosen candidates may hold together (None: no limit).
        parts: per variable, per candidate, what its `unary` cost's first component holds
            besides moves: (its own collectives, compute, memory price), in ns (the search's;
            for explanations).
    """

    domains: list[int]
    unary: list[list[Cost]]
    pairs: dict[tuple[int, int], Matrix] = field(default_factory=dict)
    anchored: set[int] = field(default_factory=set)
    width: int = 3
    memory: list[list[int]] | None = None
    peak: list[list[int]] | None = None
    cap: int | None = None
    parts: list[list[tuple[int, int, int]]] | None = None

    def zero(self) -> Cost:
        return (0,) * self.width

    def link(self, u: int, v: int, matrix: Matrix) -> None:
        """Add `matrix` (indexed [u's candidate][v's candidate]) to the pair (u, v)."""
        if u == v:  # (a value read twice by one op: only the diagonal is possible)
            for i in range(self.domains[u]):
                self.unary[u][i] = add(self.unary[u][i], matrix[i][i])
            return
        if u > v:
            u, v = v, u
            matrix = [list(row) for row in zip(*matrix, strict=True)]
        old = self.pairs.get((u, v))
        if old is None:
            self.pairs[(u, v)] = matrix
        else:
            self.pairs[(u, v)] = [
                [add(a, b) for a, b in zip(r1, r2, strict=True)]
                for r1, r2 in zip(old, matrix, strict=True)
            ]

    def neighbours(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.domains]
        for u, v in self.pairs:
            out[u].append(v)
            out[v].append(u)
        return out


def total(problem: Problem, choice: Sequence[int]) -> Cost:
    """The cost of `choice` (one candidate index per variable)."""
    cost = problem.zero()
    for v, i in enumerate(choice):
        cost = add(cost, problem.unary[v][i])
    for (u, v), m in problem.pairs.items():
        cost = add(cost, m[choice[u]][choice[v]])
    return cost


def brute_force(problem: Problem) -> list[int]:
    """The cheapest assignment by trying every one (first found on ties)."""
    best: tuple[Cost, list[int]] | None = None
    for combo in itertools.product(*(range(d) for d in problem.domains)):
        cost = total(problem, combo)
        if best is None or cost < best[0]:
            best = (cost, list(combo))
    assert best is not None
    return best[1]


def greedy(problem: Problem) -> list[int]:
    """MindSpore's breadth-first propagation (see the module docstring); a variable no search
    from a seed reaches starts a search of its own, in variable order."""
    nbrs = problem.neighbours()
    chosen: dict[int, int] = {}
    seeds = [v for v, d in enumerate(problem.domains) if d == 1] + sorted(problem.anchored)
    starts = list(dict.fromkeys(seeds + list(range(len(problem.domains)))))
    for start in starts:
        if start in chosen:
            continue
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if v in chosen:
                continue
            costs = []
            for i in range(problem.domains[v]):
                c = problem.unary[v][i]
                for u in nbrs[v]:
                    if u in chosen:
                        c = add(c, _pair(problem, v, i, u, chosen[u]))
                costs.append(c)
            chosen[v] = min(range(len(costs)), key=costs.__getitem__)
            queue.extend(u for u in nbrs[v] if u not in chosen)
    return [chosen[v] for v in range(len(problem.domains))]


def _pair(problem: Problem, v: int, i: int, u: int, j: int) -> Cost:
    if v < u:
        return problem.pairs[(v, u)][i][j]
    return problem.pairs[(u, v)][j][i]


def _is_forest(problem: Problem) -> bool:
    parent = list(range(len(problem.domains)))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in problem.pairs:
        ru, rv = root(u), root(v)
        if ru == rv:
            return False
        parent[ru] = rv
    return True


def solve(problem: Problem) -> tuple[list[int], str]:
    """The cheapest assignment, exactly: (candidate per variable, the method: ``"tree"`` or
    ``"ilp"``)."""
    if problem.cap is None and _is_forest(problem):
        return _tree_dp(problem), "tree"
    return _ilp(problem), "ilp"


def _tree_dp(problem: Problem) -> list[int]:
    nbrs = problem.neighbours()
    n = len(problem.domains)
    choice = [-1] * n
    seen = [False] * n
    for root in range(n):
        if seen[root]:
            continue
        order, parent = [], {root: -1}
        stack = [root]
        seen[root] = True
        while stack:
            v = stack.pop()
            order.append(v)
            for u in nbrs[v]:
                if not seen[u]:
                    seen[u] = True
                    parent[u] = v
                    stack.append(u)
        # per variable and candidate: its subtree's best cost
        best: dict[int, list[Cost]] = {}
        pick: dict[int, list[int]] = {}  # v -> per parent candidate, v's best candidate
        for v in reversed(order):
            own = list(problem.unary[v])
            for u in nbrs[v]:
                if parent.get(u) == v:
                    own = [
                        add(own[i], _message(problem, u, v, i, best, pick)) for i in range(len(own))
                    ]
            best[v] = own
        for v in order:
            p = parent[v]
            if p == -1:
                choice[v] = min(range(len(best[v])), key=best[v].__getitem__)
            else:
                choice[v] = pick[v][choice[p]]
    return choice


def _message(
    problem: Problem,
    u: int,
    v: int,
    i: int,
    best: dict[int, list[Cost]],
    pick: dict[int, list[int]],
) -> Cost:
    """The cheapest cost of child `u`'s subtree when its parent `v` takes candidate `i` (and
    `u`'s argmin for it, kept in `pick`)."""
    costs = [add(best[u][j], _pair(problem, u, j, v, i)) for j in range(problem.domains[u])]
    j = min(range(len(costs)), key=costs.__getitem__)
    pick.setdefault(u, [0] * problem.domains[v])[i] = j
    return costs[j]


class _Rows:
    """A sparse constraint matrix built row by row (equality rows)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.rhs: list[float] = []

    def add(self, terms: list[tuple[int, float]], rhs: float) -> None:
        r = len(self.rhs)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.rhs.append(rhs)


def _cap_rows(problem: Problem, offsets: list[int], n: int, top: int) -> list[Any]:
    """The memory cap's ILP rows: the chosen candidates' held bytes plus `top` (a continuous
    variable at least each chosen candidate's transient, `Problem.peak`; -1: none) under
    ``problem.cap``."""
    from scipy.optimize import LinearConstraint

    assert problem.memory is not None and problem.cap is not None
    rows = []
    row = np.zeros(n)
    for v, d in enumerate(problem.domains):
        for i in range(d):
            row[offsets[v] + i] = problem.memory[v][i]
    if top >= 0:
        assert problem.peak is not None
        row[top] = 1.0
        for v, d in enumerate(problem.domains):  # top >= each chosen transient
            if any(problem.peak[v]):
                tops = np.zeros(n)
                tops[offsets[v] : offsets[v] + d] = problem.peak[v]
                tops[top] = -1.0
                rows.append(LinearConstraint(tops.reshape(1, -1), -np.inf, 0.0))
    rows.append(LinearConstraint(row.reshape(1, -1), -np.inf, float(problem.cap)))
    return rows


def _ilp(problem: Problem) -> list[int]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    offsets, n = [], 0
    for d in problem.domains:
        offsets.append(n)
        n += d
    binaries = n
    pair_off: dict[tuple[int, int], int] = {}
    for u, v in problem.pairs:
        pair_off[(u, v)] = n
        n += problem.domains[u] * problem.domains[v]
    capped = problem.cap is not None and problem.memory is not None
    top = n if capped and problem.peak is not None else -1  # (the largest transient's bytes)
    n += top >= 0
    eq = _Rows()
    for v, d in enumerate(problem.domains):  # one candidate per variable
        eq.add([(offsets[v] + i, 1.0) for i in range(d)], 1.0)
    for (u, v), base in pair_off.items():  # the pair's marginals are the variables'
        du, dv = problem.domains[u], problem.domains[v]
        for i in range(du):
            eq.add([(base + i * dv + j, 1.0) for j in range(dv)] + [(offsets[u] + i, -1.0)], 0)
        for j in range(dv):
            eq.add([(base + i * dv + j, 1.0) for i in range(du)] + [(offsets[v] + j, -1.0)], 0)
    shape = (len(eq.rhs), n)
    a = coo_array((eq.vals, (eq.rows, eq.cols)), shape=shape).tocsr()
    constraints = [LinearConstraint(a, eq.rhs, eq.rhs)]
    if capped:  # the memory cap: the held bytes, plus the largest transient
        constraints += _cap_rows(problem, offsets, n, top)
    integrality = np.zeros(n)
    integrality[:binaries] = 1
    upper = np.ones(n)
    if top >= 0:
        upper[top] = np.inf
    best: list[int] | None = None
    ties = np.zeros(n)  # (last: the lowest candidate indices among the optima, as the DP)
    for v, d in enumerate(problem.domains):
        ties[offsets[v] : offsets[v] + d] = np.arange(d)
    objectives = [_objective(problem, offsets, pair_off, n, k) for k in range(problem.width)]
    for c in [*objectives, ties]:  # lexicographic: each keeps the optimum of the ones before
        if best is not None and not c.any():
            continue
        res = milp(
            c,
            constraints=constraints,
            integrality=integrality,
            bounds=Bounds(0, upper),
            options={"mip_rel_gap": 0.0},  # (exact: HiGHS stops at a 1e-4 gap by default)
        )
        if not res.success or res.x is None:
            if best is not None:  # (a tie-break HiGHS cannot meet numerically: keep the last)
                break
            if problem.cap is not None:
                raise OverCap(problem.cap)
            raise AssertionError(f"HiGHS found no assignment: {res.message}")
        x = res.x
        best = [
            int(np.argmax(x[offsets[v] : offsets[v] + d])) for v, d in enumerate(problem.domains)
        ]
        # (the next solves keep this component at the assignment's own value, exact integer
        # arithmetic, not HiGHS's float optimum, which may lie below any integer point)
        value = float(c @ _point(best, offsets, pair_off, problem, n))
        constraints.append(LinearConstraint(c.reshape(1, -1), -np.inf, value + 0.5))
    assert best is not None
    return best


def _point(
    choice: list[int],
    offsets: list[int],
    pair_off: dict[tuple[int, int], int],
    problem: Problem,
    n: int,
) -> np.ndarray:
    """The ILP's variables for one assignment (a candidate per variable, and its pairs)."""
    x = np.zeros(n)
    for v, i in enumerate(choice):
        x[offsets[v] + i] = 1.0
    for (u, v), base in pair_off.items():
        x[base + choice[u] * problem.domains[v] + choice[v]] = 1.0
    return x


def _objective(
    problem: Problem, offsets: list[int], pair_off: dict[tuple[int, int], int], n: int, k: int
) -> np.ndarray:
    """Component `k` of every candidate's and candidate pair's cost, as the ILP's vector, each
    variable's and each pair's costs less their least (a constant per factor: the same
    optimum, and small numbers that HiGHS compares exactly)."""
    c = np.zeros(n)
    for v, d in enumerate(problem.domains):
        costs = [problem.unary[v][i][k] for i in range(d)]
        low = min(costs)
        c[offsets[v] : offsets[v] + d] = [x - low for x in costs]
    for (u, v), base in pair_off.items():
        flat = [cost[k] for row in problem.pairs[(u, v)] for cost in row]
        low = min(flat)
        c[base : base + len(flat)] = [x - low for x in flat]
    return c
