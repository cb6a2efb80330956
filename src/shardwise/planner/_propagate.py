"""sharding_propagation: annotated ops keep their strategies; every other op takes the strategy
that makes the whole graph's redistributions cheapest.

`plan_sharding_propagation(graph, device_num, ...)`:

1. `_semi_auto.setup` with only the annotated primitives (a ``shard()`` strategy): their
   device matrices, declared layouts, op-form annotations and ``sw.reshard`` nodes make the
   global matrix (none at all: one axis of every device); inputs arrive as the dataset
   strategy says (MindSpore counts its dataset op as configured).
2. `_choices.Choices`: every node's and free parameter's candidate strategies.
3. `problem`: one variable per node and per free parameter; a pair of candidates linked by a
   value costs what moving the value from the producer's placement to the consumer's costs
   (`_cost.CostModel.move`: the AllReduce of partial sums, then the cheapest steps, priced
   by the alpha-beta model); values that arrive fixed (inputs, buffers, constants, declared
   parameters) cost their consumers the same way (each consumer's move priced on its own,
   although the plan moves a value two consumers take alike once). An op's own collectives
   (the AllReduce after a split contraction) are not counted, as in MindSpore. The cost is a
   tuple compared in order (`Cost`): the redistribution time in nanoseconds, then the ties,
   broken as MindSpore's seed 002 shows: the elements each rank computes (more devices used
   first), then the number of mesh axes whose placement a value changes on an edge, where a
   partial axis that splits the value's last dim counts as kept (relu after
   ``MatMul((2, 4), (4, 1))`` takes ``(2, 4)``: the contraction's axis splits the hidden dim,
   the batch keeps its axis).
4. `_solve.solve`: exact (tree DP, else an ILP through HiGHS), on the problem whose repeated
   layers' variables are tied (`_tie.solve_tied`: one variable per layer-index pattern, so the
   problem does not grow with depth; exact among the plans whose layers decide alike).
5. `_semi_auto.walk` with the chosen strategies: the primitives' plans (rule
   ``"propagated"``), the torch ops' placements, the parameters' storage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.layout import TensorLayout
from shardwise.planner._annotated import RESHARD
from shardwise.planner._choices import Choice, Choices
from shardwise.planner._cost import CostModel, load_cost_model
from shardwise.planner._explain import explain_run
from shardwise.planner._gc import gc_paused
from shardwise.planner._graph import Graph, Ref, TensorInfo
from shardwise.planner._placement import (
    DatasetStrategy,
    Placements,
    PlanError,
    Shape,
    _itemsize,
    placements_of,
    to_placed,
)
from shardwise.planner._plan import ParallelPlan, Placed
from shardwise.planner._semi_auto import Setup, setup, walk
from shardwise.planner._solve import Cost, Matrix, Problem, add, greedy, solve
from shardwise.planner._tie import layer_keys, solve_tied


def changes(
    src: Placements, dst: Placements, ndim: int, reduced: frozenset[int] = frozenset()
) -> int:
    """Mesh axes whose placement differs between `src` and `dst`; an axis over which the
    producer's value is partial, or was just reduced by the producer's own collective
    (`reduced`), counts as kept when it splits the last dim in `dst`."""
    n = 0
    for axis, (a, b) in enumerate(zip(src, dst, strict=True)):
        freed = isinstance(a, Partial) or axis in reduced
        if freed and b == Shard(ndim - 1):
            continue
        if a != b:
            n += 1
    return n


@dataclass
class Propagation:
    """One propagation run: the choices, the problem and its solution.

    Attributes:
        setup: `_semi_auto.setup`'s result.
        choices: the candidates.
        problem: the `_solve.Problem`.
        variables: ``("node", index)`` or ``("param", name)`` per variable.
        assignment: the chosen candidate per variable.
        method: how it was solved (``"tree"``, ``"ilp"``, ``"greedy"``).
        fixed: the variables of annotated nodes (one candidate: the user's).
    """

    setup: Setup
    choices: Choices
    problem: Problem
    variables: list[tuple[str, int | str]]
    assignment: list[int]
    method: str
    fixed: frozenset[int] = frozenset()


class _Builder:
    """Builds the `Problem` of a graph's choices (step 3 of the module docstring).

    `price_own`: whether the AllReduce of partial sums that a producer's own strategy made
    (`Choice.own`: a torch op contracting a split dim, as a row-parallel ``nn.Linear``) is
    priced. Propagation does not: as MindSpore's ops (and shardwise's primitives) reduce inside
    the op, the value is priced as leaving its producer reduced, its AllReduce the op's own
    collective; a consumer that takes it partial instead (an add passing partial sums on)
    makes a new partial value, whose reduction is priced where it happens. The search
    (`_search._Costs`) prices every reduction.
    """

    price_own = False

    def __init__(self, graph: Graph, s: Setup, choices: Choices, model: CostModel) -> None:
        self.graph, self.s, self.choices, self.model = graph, s, choices, model
        self.var: dict[tuple[str, int | str], int] = {}
        for node in graph.nodes:
            self.var[("node", node.index)] = len(self.var)
        for name in graph.params:
            if name not in s.given and name not in s.pinned:
                self.var[("param", name)] = len(self.var)
        self._moves: dict[object, Cost] = {}
        self._lists: dict[tuple[int, ...], int] = {}
        self._matrices: dict[object, Matrix] = {}

    def move(
        self,
        src: Placements,
        dst: Placements,
        info: TensorInfo,
        reduced: frozenset[int] = frozenset(),
        own: frozenset[int] = frozenset(),
        weight: int = 1,
    ) -> Cost:
        """The cost of an edge: (ns, 0, axes changed); `reduced`: the producer's (`changes`);
        `own`: the axes its own strategy left partial (`Choice.own`); `weight`: its seconds
        counted that many times (`weight`)."""
        key = (src, dst, info, reduced, own, weight)
        if key not in self._moves:
            m = self.s.planner.matrix
            if own and not self.price_own:  # (reduced by the producer itself: its collective)
                src = tuple(Replicate() if x in own else p for x, p in enumerate(src))
                reduced = reduced | own
            a, b = to_placed(m, src, len(info.shape)), to_placed(m, dst, len(info.shape))
            partial = tuple(x for x in a.partial if x not in b.partial)
            secs = self.model.move(  # (a ReduceScatter for a sum only, as the executor)
                a.layout, b.layout, info.shape, _itemsize(info.dtype), partial, a.reduce == "sum"
            )
            turned = changes(src, dst, len(info.shape), reduced)
            self._moves[key] = (round(secs * weight * 1e9), 0, turned)
        return self._moves[key]

    def weight(self, ref: Ref) -> int:
        """How many times the moves of value `ref` are priced: once (the forward's; the search
        also prices their adjoints in backward: `_search._Costs`)."""
        return 1

    def _fixed(self, ref: Ref) -> Placements:
        if ref.kind == "param":
            name = str(ref.key)
            layout = self.s.given.get(name, self.s.pinned.get(name))
            assert layout is not None
            return placements_of(Placed(layout))
        return placements_of(self.s.planner.state[ref])

    def problem(self) -> tuple[Problem, list[tuple[str, int | str]]]:
        variables = list(self.var)
        domains: list[int] = []
        unary: list[list[Cost]] = []
        for kind, key in variables:
            if kind == "node":
                cs = self.choices.nodes[int(key)]
                domains.append(len(cs))
                unary.append([(0, c.compute, 0) for c in cs])
            else:
                domains.append(len(self.choices.params[str(key)]))
                unary.append([(0, 0, 0)] * domains[-1])
        prob = Problem(domains, unary)
        for node in self.graph.nodes:
            self._link(prob, node.index)
        return prob, variables

    def _same(self, choices: Sequence[object]) -> int:
        """A number per list of the same candidate objects (repeated layers share them)."""
        return self._lists.setdefault(tuple(map(id, choices)), len(self._lists))

    def _matrix(
        self,
        theirs: Sequence[object],
        out: int,
        mine: list[Choice],
        slot: int,
        info: TensorInfo,
        w: int = 1,
    ) -> Matrix:
        """The move costs from each of `theirs` (`Choice`s: their output `out`; or parameter
        placements) to each of `mine`'s input `slot`, priced `w` times (`weight`); memoized per
        list of candidates."""
        key = (self._same(theirs), out, self._same(mine), slot, info, w)
        found = self._matrices.get(key)
        if found is None:
            found = self._matrices[key] = [
                [self.move(t.outs[out], c.need[slot], info, t.reduced, t.own, w) for c in mine]
                if isinstance(t, Choice)
                else [self.move(t, c.need[slot], info, weight=w) for c in mine]  # type: ignore[arg-type]
                for t in theirs
            ]
        return found

    def _link(self, prob: Problem, index: int) -> None:
        node = self.graph.nodes[index]
        v = self.var[("node", index)]
        mine: list[Choice] = self.choices.nodes[index]
        for slot, ref in enumerate(node.inputs):
            info, w = self.graph.info(ref), self.weight(ref)
            if ref.kind == "node":
                q = int(ref.key)
                matrix = self._matrix(self.choices.nodes[q], ref.index, mine, slot, info, w)
                prob.link(self.var[("node", q)], v, matrix)
            elif ref.kind == "param" and ("param", str(ref.key)) in self.var:
                options = self.choices.params[str(ref.key)]
                matrix = self._matrix(options, 0, mine, slot, info, w)
                prob.link(self.var[("param", str(ref.key))], v, matrix)
            else:
                src = self._fixed(ref)
                for j, c in enumerate(mine):
                    cost = self.move(src, c.need[slot], info, weight=w)
                    prob.unary[v][j] = add(prob.unary[v][j], cost)
                if ref.kind == "input":
                    prob.anchored.add(v)


def _check_shared(graph: Graph, s: Setup, choices: Choices) -> None:
    """Refuse a parameter that two annotated ops read in different layouts (MindSpore names
    such annotations contradictory): naming both ops, their layouts and the fix."""
    m = s.planner.matrix
    seen: dict[str, tuple[str, Placed]] = {}
    for node in graph.nodes:
        if node.index not in s.prims and node.index not in s.planner.pinned:
            continue
        (c,) = choices.nodes[node.index]
        for slot, ref in enumerate(node.inputs):
            if ref.kind != "param" or str(ref.key) in s.given:
                continue
            layout = to_placed(m, c.need[slot], len(graph.info(ref).shape)).layout
            placed = Placed(layout)
            first = seen.setdefault(str(ref.key), (node.name, placed))
            if first[1] != placed:
                raise PlanError(
                    f"contradictory annotations: parameter {str(ref.key)!r} is read as "
                    f"{first[1]} by {first[0]} and as {placed} by {node.name}, both annotated "
                    f"with shard(); give both ops strategies that split it alike, or leave one "
                    f"unannotated so that propagation chooses it"
                )


def problem_of(
    graph: Graph,
    device_num: int,
    dataset: DatasetStrategy,
    param_layouts: Mapping[str, TensorLayout] | None,
    extra_matrices: Sequence[Shape],
    model: CostModel,
    builder: Callable[[Graph, Setup, Choices, CostModel], _Builder] = _Builder,
) -> tuple[Setup, Choices, Problem, list[tuple[str, int | str]]]:
    """Steps 1-3 (shared with the search, whose `builder` adds its costs): the setup with the
    annotated ops, every candidate, the `Problem` and its variables."""
    s = setup(graph, device_num, dataset, param_layouts, extra_matrices, annotated_only=True)
    choices = Choices(s.planner, graph, s.prims, {**s.given, **s.pinned}).build()
    _check_shared(graph, s, choices)
    problem, variables = builder(graph, s, choices, model).problem()
    return s, choices, problem, variables


def fixed_variables(
    graph: Graph, s: Setup, variables: list[tuple[str, int | str]]
) -> frozenset[int]:
    """The variables of annotated nodes (primitives with ``shard()``, op-form annotations,
    ``sw.reshard``): one candidate each, the user's."""
    annotated = set(s.prims) | set(s.planner.pinned)
    annotated |= {n.index for n in graph.nodes if n.op == RESHARD}
    return frozenset(v for v, (k, key) in enumerate(variables) if k == "node" and key in annotated)


@gc_paused
def propagate(
    graph: Graph,
    device_num: int,
    *,
    dataset: DatasetStrategy = "data_parallel",
    param_layouts: Mapping[str, TensorLayout] | None = None,
    extra_matrices: Sequence[Shape] = (),
    model: CostModel | None = None,
    method: str = "exact",
    tie_layers: bool = True,
) -> Propagation:
    """Choose every unannotated op's strategy (steps 1-4 of the module docstring; `method`
    ``"greedy"``: MindSpore's breadth-first propagation instead of the exact solution;
    `tie_layers`: repeated layers decide alike, `_tie`)."""
    if method not in ("exact", "greedy"):
        raise ValueError(f"propagate: method {method!r}; valid: 'exact' | 'greedy'")
    s, choices, problem, variables = problem_of(
        graph, device_num, dataset, param_layouts, extra_matrices, model or load_cost_model()
    )
    if method == "greedy":
        assignment, how = greedy(problem), "greedy"
    elif tie_layers:
        assignment, how = solve_tied(problem, layer_keys(graph, choices, variables))
    else:
        assignment, how = solve(problem)
    fixed = fixed_variables(graph, s, variables)
    return Propagation(s, choices, problem, variables, assignment, how, fixed)


@gc_paused
def plan_sharding_propagation(
    graph: Graph,
    device_num: int,
    *,
    dataset: DatasetStrategy = "data_parallel",
    param_layouts: Mapping[str, TensorLayout] | None = None,
    extra_matrices: Sequence[Shape] = (),
    model: CostModel | None = None,
    method: str = "exact",
) -> ParallelPlan:
    """Plan a captured graph by sharding propagation (see the module docstring).

    Args:
        graph: from `capture`.
        device_num: the job's size.
        dataset: as `plan_semi_auto`'s.
        param_layouts: parameter name -> its declared storage layout.
        extra_matrices: device-matrix shapes the global matrix must refine.
        model: the cost model (default: `load_cost_model`).
        method: ``"exact"`` (default) or ``"greedy"`` (MindSpore's breadth-first order).

    Returns:
        The `ParallelPlan` (mode ``"sharding_propagation"``).

    Raises:
        PlanError: an annotated op that cannot be split as asked, or an op with no strategy
            on the global matrix.

    Example:
        >>> plan = plan_sharding_propagation(capture(net, x), device_num=8)
        >>> plan.node("relu").inputs[0]  # doctest: +SKIP
    """
    run = propagate(
        graph,
        device_num,
        dataset=dataset,
        param_layouts=param_layouts,
        extra_matrices=extra_matrices,
        model=model,
        method=method,
    )
    return build_plan(graph, run)


@gc_paused
def build_plan(graph: Graph, run: Propagation, mode: str = "sharding_propagation") -> ParallelPlan:
    """The `ParallelPlan` of a solved `Propagation` (step 5), made by `mode`; once per run (it
    records the decisions in the run's planner)."""
    s, p = run.setup, run.setup.planner
    assert not p.nodes, "build_plan: a Propagation builds one plan"
    params = dict(s.given)
    for name, layout in s.pinned.items():
        params.setdefault(name, layout)
    rules: dict[int, str] = {}
    for (kind, key), pick in zip(run.variables, run.assignment, strict=True):
        if kind == "param":
            shape = graph.params[str(key)].shape
            params[str(key)] = to_placed(
                p.matrix, run.choices.params[str(key)][pick], len(shape)
            ).layout
            continue
        index = int(key)
        c = run.choices.nodes[index][pick]
        node = graph.nodes[index]
        if node.index in s.prims or node.index in p.pinned:
            continue
        if c.plan is not None:
            s.prims[index] = c.plan
            rules[index] = "propagated" if mode == "sharding_propagation" else "searched"
        elif node.op != RESHARD:
            p.chosen[index] = (list(c.need), list(c.outs), c.rule)
    for name, info in graph.params.items():
        params.setdefault(name, TensorLayout(p.matrix, ((),) * len(info.shape)))
    ordered = {n: params[n] for n in graph.params}
    plan = walk(graph, s, ordered, mode, rules)
    return dataclasses.replace(plan, explained=explain_run(graph, run, mode))
