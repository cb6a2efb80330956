"""The methods of `AutoParallel` that read its plan (`PlanReading`): `parallel_plan`,
`stored_plan`, `holds_blocks` (what the run stores), `strategies` (each op's
in_strategy) and `explain` (why an op has its strategy: an automatic mode's explanation with its
alternatives, else `_explain_rule`: the rule semi_auto or a loaded plan took it from and what the
op moves); `dump_first_plan` writes a first plan's report files (the plan, the optimizer's or
the gradient buckets' plan).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from shardwise import report
from shardwise.planner import ParallelPlan, regathered_params

if TYPE_CHECKING:
    from shardwise.parallel._graph_run import GraphRun


def dump_first_plan(run: GraphRun, plan: ParallelPlan) -> None:
    """Write the report files of `run`'s first `plan` (`report.dump_parallel_plan`, then the
    optimizer-parallel engine's plan, with level 3's buckets gathered again in backward, or the
    gradient buckets' plan)."""
    variant = report.next_variant()
    report.dump_parallel_plan(plan, variant=variant)
    if run.engine is not None:
        again = regathered_params(plan)
        report.dump_optimizer(run.engine.plan, plan.matrix, variant=variant, regathered=again)
    elif run.grad_plan is not None:
        report.dump_optimizer(run.grad_plan, plan.matrix, variant=variant)


class PlanReading:
    """Mixed into `AutoParallel` (which sets `_graph`, its semi_auto run, and
    `parallel_mode`)."""

    if TYPE_CHECKING:
        _graph: GraphRun | None
        parallel_mode: str

    @property
    def holds_blocks(self) -> bool:
        """Whether the network's parameters hold this rank's blocks or optimizer-parallel
        shards (False before planning, in data_parallel mode, or when every parameter is
        whole): a plain forward of the network outside the wrapper is then refused."""
        return self._graph is not None and self._graph.blocks

    @property
    def stored_plan(self) -> ParallelPlan | None:
        """The plan the parameters are stored by (the first one made; None before planning)."""
        return self._graph.stored_plan if self._graph is not None and self._graph.plans else None

    @property
    def parallel_plan(self) -> ParallelPlan | None:
        """The `ParallelPlan` the wrapper runs (None before the first call or `plan`)."""
        return None if self._graph is None else self._graph.parallel_plan

    def _planned(self, what: str) -> ParallelPlan:
        """The plan `what` (``"strategies"``) reads, or a ValueError saying why there is none
        (nothing planned yet; data_parallel mode, which runs no operator plan)."""
        plan = self.parallel_plan
        if plan is not None:
            return plan
        if self.parallel_mode == "data_parallel":
            raise ValueError(
                f"AutoParallel.{what}: parallel_mode='data_parallel' runs no operator plan (every "
                f"op data parallel, as DDP: the gradients averaged at the optimizer's step); "
                f"plans are made by 'semi_auto', 'sharding_propagation' and "
                f"'recursive_programming'"
            )
        raise ValueError(
            f"AutoParallel.{what}: nothing planned yet; call the wrapper (or its plan()) once first"
        )

    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each op's name (module path and op, as the IR prints it) -> its in_strategy, for
        annotated, propagated and data-parallel ops alike (`ParallelPlan.strategies`).

        Raises:
            ValueError: nothing planned yet (call the wrapper or its ``plan`` first), or
                data_parallel mode (no operator plan).

        Example:
            >>> parallel_net.strategies()["relu/ReLU"]  # seed 002, sharding_propagation
            ((2, 4),)
        """
        return self._planned("strategies").strategies()

    def explain(self, name: str) -> str:
        """Why op `name` has its strategy: the strategy, where it came from (annotated, or the
        annotated op / dataset it was propagated from) and the alternatives considered, each
        with its communication (redistributions on the op's edges, by the cost model), compute
        and memory cost (`planner.Explanation`).

        Args:
            name: the op's name as `strategies` and the IR print it (``"relu/ReLU"``).

        A plan that weighed no alternatives (semi_auto, a loaded file) gives the strategy, the
        rule it came from (annotated, a primitive's default, the op's sharding rule on its
        inputs as they come) and the moves and collectives of the op.

        Raises:
            ValueError: nothing planned yet, data_parallel mode, or an unknown name (the message
                lists near names).

        Example:
            >>> print(parallel_net.explain("relu/ReLU"))  # seed 002
            relu/ReLU: ((2, 4),) (propagated from matmul/MatMul (annotated))
                ((2, 4),): comm 0.0 us, compute 32 elements, memory 256 B  <- chosen
                ...
        """
        plan = self._planned("explain")
        if name in plan.explained:
            return str(plan.explained[name])
        names = [n.name for n in plan.nodes]
        if name not in names:
            near = [n for n in names if name in n][:5]  # ('mm1' -> 'mm1/MatMul')
            near = near or difflib.get_close_matches(name, names, n=5, cutoff=0.6)
            hint = f"close: {near}" if near else f"its ops: {_listed(names)}"
            raise ValueError(f"AutoParallel.explain: no op {name!r} in the plan; {hint}")
        return _explain_rule(plan, names.index(name))


def _listed(names: list[str], most: int = 12) -> str:
    """`names` for an error message: the first `most`, then how many more."""
    if len(names) <= most:
        return str(names)
    return f"{names[:most]} and {len(names) - most} more (strategies() lists them all)"


_RULES = {
    "user": "annotated: its shard() strategy",
    "default": "a primitive's data-parallel default (not annotated)",
    "dtensor": "not annotated: it takes its inputs as they come, by DTensor's sharding rule, "
    "unless the data-parallel strategy moves less",
    "shardwise": "not annotated: it takes its inputs as they come, by shardwise's rule for "
    "the op, unless the data-parallel strategy moves less",
    "factory": "a factory: its output made in its layout where it runs",
    "replicate": "not annotated, and no rule runs it split: it runs on whole inputs",
    "propagated": "sharding propagation's choice",
    "searched": "the strategy search's choice",
}


def _explain_rule(plan: ParallelPlan, index: int) -> str:
    """Op `index` of a plan that weighed no alternatives (semi_auto, a loaded plan): its
    strategy, the rule it came from and what it moves."""
    node = plan.nodes[index]
    lines = [f"{node.name}: {node.in_strategy} ({_RULES.get(node.rule, node.rule)})"]
    moved = [str(e) for e in plan.edges_by_consumer().get(index, []) if e.steps or e.reduced]
    lines += [f"    input moved: {m}" for m in moved]
    lines += [f"    runs: {c}" for c in node.comms]
    if plan.mode == "semi_auto":
        lines.append(
            "    (semi_auto weighs no alternatives: annotated ops keep their strategies, the "
            "others follow; parallel_mode='sharding_propagation' or 'recursive_programming' "
            "price each op's candidates)"
        )
    else:
        lines.append(
            f"    (a {plan.mode} plan loaded from a file carries no alternatives: plan without "
            f"loading it to see them)"
        )
    return "\n".join(lines)
