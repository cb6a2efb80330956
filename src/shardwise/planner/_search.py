"""recursive_programming: every op's strategy chosen by the total cost of the plan.

`plan_recursive_programming(graph, device_num, ...)` is MindSpore's default automatic mode,
solved exactly over shardwise's candidates. Annotations are constraints (they stay fixed, as
in sharding propagation); nothing needs to be annotated.

1. **Device matrices.** With annotations the matrix is theirs. Without, every way to lay the
   devices out on one or two named axes is tried (``(8,)``, ``(2, 4)``, ``(4, 2)`` for 8
   devices): the data-parallel plan lives on the first, Megatron-style dp x mp plans on the
   others.
2. **Candidates** as for propagation (`_choices.Choices`), and one variable per node and free
   parameter.
3. **Cost** of a candidate, all in seconds (`_cost.CostModel`): the redistributions on its
   edges (as propagation; twice for a value a train step's backward computes the gradient of,
   `gradient_refs`: the adjoint moves as many bytes), plus its own collectives (a primitive's
   AllReduce after a split contraction, priced like any AllReduce; twice too), plus its
   compute (`_flops.node_flops` over the devices that share it, at ``flops_per_s``), plus the
   memory it holds on a rank (its outputs' blocks, kept for backward; a parameter's block with
   its gradient and the optimizer's state: Adam's two moments by default, the job's
   optimizer's under `AutoParallel`) at ``memory_s_per_byte``; a parameter's gradient
   AllReduce over the axes that replicate it (its data-parallel synchronization, once a step).
   With ``sw.runtime.set_memory`` the chosen candidates' memory must also fit under the cap
   (an ILP row; a plan that cannot is a `PlanError` naming a lower bound of the memory any
   plan needs).
4. `_solve.solve` per matrix (exact; repeated layers tied, `_tie.solve_tied`, so they decide
   alike and the problem does not grow with depth), the cheapest matrix wins;
   `_semi_auto.walk` builds the plan (mode ``"recursive_programming"``), with `_explain`
   explanations.
5. For a train step (a graph with a backward) without annotations, every matrix's plan is
   built instead and the plans compared by their whole training step (`step_cost`: the
   backward's collectives as the executor runs them, which the per-matrix cost only
   approximates, the gradient buckets and the optimizer's update) plus their memory's price.

`plan_cost` prices any `ParallelPlan` of the graph by the same model (the data-parallel one,
a hand-written Megatron one, a propagated one), so plans compare side by side; for a graph without a
backward the search's plan is never costlier than any plan in its candidate space by the
search's own pricing (the job's optimizer state; `plan_cost` counts Adam's, and the few
reductions the executor keeps whole as AllReduces); for a train step compare `step_cost`s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise import runtime
from shardwise.layout import TensorLayout
from shardwise.planner._annotated import RESHARD
from shardwise.planner._choices import Choice, Choices
from shardwise.planner._cost import CostModel, load_cost_model
from shardwise.planner._flops import node_flops
from shardwise.planner._gc import gc_paused
from shardwise.planner._graph import Graph, Ref
from shardwise.planner._placement import (
    DatasetStrategy,
    PlanError,
    Shape,
    _global_axes,
    _itemsize,
    to_placed,
)
from shardwise.planner._plan import ParallelPlan
from shardwise.planner._plan_cost import grad_sync, plan_cost, step_cost
from shardwise.planner._propagate import (
    Propagation,
    _Builder,
    build_plan,
    fixed_variables,
    problem_of,
)
from shardwise.planner._semi_auto import Setup
from shardwise.planner._solve import OverCap, Problem, total
from shardwise.planner._tie import layer_keys, solve_tied


def gradient_refs(graph: Graph) -> set[Ref]:
    """The values a train step's backward computes a gradient of: the floating parameters that
    are not frozen and every floating output of an op with such an input (none without a
    backward: a forward-only graph)."""
    if not graph.roots:
        return set()
    needs = {
        Ref("param", n)
        for n, info in graph.params.items()
        if info.dtype.startswith("float") and n not in graph.frozen
    }
    for node in graph.nodes:
        if any(r in needs for r in node.inputs):
            needs.update(
                Ref("node", node.index, i)
                for i, info in enumerate(node.outputs)
                if info.dtype.startswith("float")
            )
    return needs


def matrix_shapes(device_num: int) -> list[Shape]:
    """The device matrices the search tries without annotations: one axis, then every split
    into two axes of at least 2 devices each."""
    out: list[Shape] = [(device_num,)]
    out += [(a, device_num // a) for a in range(2, device_num) if device_num % a == 0]
    return out


class _Costs(_Builder):
    """`_propagate._Builder` with the search's full cost (step 3 of the module docstring)."""

    price_own = True  # (a torch op's partial sums are reduced on its out-edges: priced)

    def __init__(
        self, graph: Graph, s: Setup, choices: Choices, model: CostModel, copies: int
    ) -> None:
        super().__init__(graph, s, choices, model)
        self.copies = copies  # (a parameter's block, its gradient and the optimizer's state)
        self.needs = gradient_refs(graph)

    def weight(self, ref: Ref) -> int:
        """Twice for a value backward computes a gradient of (the move's adjoint: an AllGather's
        ReduceScatter, a Slice's AllGather later, an AlltoAll's reverse, as many bytes)."""
        return 2 if ref in self.needs else 1

    def problem(self) -> tuple[Problem, list[tuple[str, int | str]]]:
        prob, variables = super().problem()
        memory: list[list[int]] = []
        peak: list[list[int]] = []
        parts: list[list[tuple[int, int, int]]] = []
        for v, (kind, key) in enumerate(variables):
            if kind == "node":
                own = [self._own(int(key), c) for c in self.choices.nodes[int(key)]]
                peak.append([0] * len(own))
            else:
                own = [self._param(str(key), j) for j in range(prob.domains[v])]
                floating = self.graph.params[str(key)].dtype.startswith("float")
                # (an Adam-like update's two temporaries of the largest block: as the check)
                temps = 2 if self.copies >= 4 and floating else 0
                peak.append([m // self.copies * temps for _, m in own])
            memory.append([m for _, m in own])
            parts.append([split for split, _ in own])
            prob.unary[v] = [
                (cost[0] + sum(split), 0, cost[2])
                for cost, (split, _) in zip(prob.unary[v], own, strict=True)
            ]
        prob.memory, prob.parts = memory, parts
        prob.peak = peak if any(any(row) for row in peak) else None
        return prob, variables

    def _own(self, index: int, c: Choice) -> tuple[tuple[int, int, int], int]:
        """((ns of the choice's own collectives, of its compute, its memory price), its bytes)."""
        node, m, model = self.graph.nodes[index], self.s.planner.matrix, self.model
        secs = 0.0
        if c.plan is not None:
            for comm in c.plan.comms:
                info = node.outputs[comm.output]
                layout = to_placed(m, c.outs[comm.output], len(info.shape)).layout
                block = math.prod(layout.local_shape(info.shape)) * _itemsize(info.dtype)
                axes = [m.names.index(g) for g in _global_axes(c.plan.matrix, comm.axes, m)]
                secs += model.combine(comm.kind, block, m, axes) * self.weight(
                    Ref("node", index, comm.output)
                )
        shapes = [self.graph.info(r).shape for r in node.inputs]
        flops = node_flops(node.op, shapes, [o.shape for o in node.outputs])
        compute = flops / c.split / model.flops_per_s
        held = 0
        for placed, info in zip(c.outs, node.outputs, strict=True):
            layout = to_placed(m, placed, len(info.shape)).layout
            held += math.prod(layout.local_shape(info.shape)) * _itemsize(info.dtype)
        priced = held * model.memory_s_per_byte
        return (round(secs * 1e9), round(compute * 1e9), round(priced * 1e9)), held

    def _param(self, name: str, j: int) -> tuple[tuple[int, int, int], int]:
        """((ns of the parameter's gradient AllReduce over the axes that replicate it, 0, its
        memory price), the bytes it holds with its gradient and optimizer state)."""
        info = self.graph.params[name]
        m = self.s.planner.matrix
        layout = to_placed(m, self.choices.params[name][j], len(info.shape)).layout
        block = math.prod(layout.local_shape(info.shape)) * _itemsize(info.dtype)
        secs = grad_sync(self.model, layout, block) if info.dtype.startswith("float") else 0.0
        held = block * self.copies
        return (round(secs * 1e9), 0, round(held * self.model.memory_s_per_byte * 1e9)), held


@dataclass
class Searched:
    """The search's result: the winning propagation-style run and every matrix's total."""

    run: Propagation
    totals: dict[Shape, float]  # matrix shape -> its best plan's cost in seconds
    runs: dict[Shape, Propagation]  # matrix shape -> its best plan's run (every matrix tried)


@gc_paused
def search(
    graph: Graph,
    device_num: int,
    *,
    dataset: DatasetStrategy = "data_parallel",
    param_layouts: Mapping[str, TensorLayout] | None = None,
    extra_matrices: Sequence[Shape] = (),
    model: CostModel | None = None,
    tie_layers: bool = True,
    state_per_element: int = 2,
) -> Searched:
    """Steps 1-4 of the module docstring, without building the plan (`tie_layers`: repeated
    layers decide alike, `_tie`; `state_per_element`: the optimizer's state per parameter
    element, `report.optimizer_state_per_element`)."""
    model = model or load_cost_model()
    costs = functools.partial(_Costs, copies=2 + state_per_element)
    cap = runtime.get_memory()
    annotated = _annotated(graph, param_layouts, dataset, extra_matrices)
    shapes = [()] if annotated else matrix_shapes(device_num)
    totals: dict[Shape, float] = {}
    runs: dict[Shape, Propagation] = {}
    least: int | None = None
    for shape in shapes:
        extra = [*extra_matrices, shape] if shape else list(extra_matrices)
        s, choices, problem, variables = problem_of(
            graph, device_num, dataset, param_layouts, extra, model, costs
        )
        assert problem.memory is not None
        floor = sum(min(row) for row in problem.memory)
        floor += max((min(row) for row in problem.peak or []), default=0)
        least = floor if least is None else min(least, floor)
        if cap is not None:
            problem.cap = cap
            if floor > cap:
                continue
        keys = layer_keys(graph, choices, variables) if tie_layers else [None] * len(variables)
        try:
            assignment, how = solve_tied(problem, keys)
        except OverCap:
            continue
        cost = total(problem, assignment)[0] / 1e9
        totals[s.planner.matrix.shape] = cost
        fixed = fixed_variables(graph, s, variables)
        run = Propagation(s, choices, problem, variables, assignment, how, fixed)
        runs[s.planner.matrix.shape] = run
    if not runs:
        raise _over_cap(cap or 0, least or 0)
    return Searched(runs[min(totals, key=totals.__getitem__)], totals, runs)


def _over_cap(cap: int, least: int) -> PlanError:
    return PlanError(
        f"recursive_programming: no plan fits the set_memory cap of {runtime.format_size(cap)}: "
        f"any plan needs at least {runtime.format_size(least)} on a rank (the least memory of "
        f"each op's and parameter's strategies summed); raise the cap or use more devices"
    )


def _annotated(
    graph: Graph,
    param_layouts: Mapping[str, TensorLayout] | None,
    dataset: DatasetStrategy,
    extra: Sequence[Shape],
) -> bool:
    if param_layouts or extra or isinstance(dataset, Mapping):
        return True
    for node in graph.nodes:
        if node.strategy or node.op == RESHARD:
            return True
        if node.is_primitive and node.target.in_strategy is not None:
            return True
    return False


@gc_paused
def plan_recursive_programming(
    graph: Graph,
    device_num: int,
    *,
    dataset: DatasetStrategy = "data_parallel",
    param_layouts: Mapping[str, TensorLayout] | None = None,
    extra_matrices: Sequence[Shape] = (),
    model: CostModel | None = None,
    state_per_element: int = 2,
) -> ParallelPlan:
    """Plan a captured graph by the search (see the module docstring).

    Args:
        graph: from `capture`.
        device_num: the job's size.
        dataset: as `plan_semi_auto`'s.
        param_layouts: parameter name -> its declared storage layout.
        extra_matrices: device-matrix shapes the global matrix must refine.
        model: the cost model (default: `load_cost_model`).
        state_per_element: elements of state the job's optimizer keeps per parameter element
            (`report.optimizer_state_per_element`: Adam 2, SGD with momentum 1, plain SGD 0),
            held with each parameter's block and gradient in the memory the search prices and
            caps; `AutoParallel` passes its optimizer's.

    Returns:
        The `ParallelPlan` (mode ``"recursive_programming"``).

    Raises:
        PlanError: no plan fits the ``set_memory`` cap; annotations that contradict.

    Example:
        >>> plan = plan_recursive_programming(capture(step, ids, ids), device_num=8)
    """
    model = model or load_cost_model()
    found = search(
        graph,
        device_num,
        dataset=dataset,
        param_layouts=param_layouts,
        extra_matrices=extra_matrices,
        model=model,
        state_per_element=state_per_element,
    )
    if len(found.runs) == 1 or not graph.roots:  # (no backward: the search's own cost)
        return build_plan(graph, found.run, mode="recursive_programming")
    plans = [build_plan(graph, run, mode="recursive_programming") for run in found.runs.values()]
    return min(plans, key=lambda plan: _step_price(plan, model))


def _step_price(plan: ParallelPlan, model: CostModel) -> float:
    """A plan's training step by `step_cost` (its backward's collectives, gradient buckets and
    optimizer too), plus the price of the memory it holds: how the matrices' plans compare
    (step 5 of the module docstring)."""
    return step_cost(plan, model).total + plan_cost(plan, model).memory
