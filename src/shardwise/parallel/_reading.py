"""The methods of `AutoParallel` that read its plan (`PlanReading`): `strategies` (each op's
in_strategy) and `explain` (why an automatically planned op has its strategy).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from shardwise.planner import ParallelPlan


class PlanReading:
    """Mixed into `AutoParallel` (which provides `parallel_plan`)."""

    if TYPE_CHECKING:

        @property
        def parallel_plan(self) -> ParallelPlan | None: ...

    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each op's name (module path and op, as the IR prints it) -> its in_strategy, for
        annotated, propagated and data-parallel ops alike (`ParallelPlan.strategies`).

        Raises:
            ValueError: nothing planned yet (call the wrapper or its ``plan`` first).

        Example:
            >>> parallel_net.strategies()["relu/ReLU"]  # seed 002, sharding_propagation
            ((2, 4),)
        """
        plan = self.parallel_plan
        if plan is None:
            raise ValueError(
                "AutoParallel.strategies: nothing planned yet; call the wrapper (or its plan()) "
                "once first"
            )
        return plan.strategies()

    def explain(self, name: str) -> str:
        """Why op `name` has its strategy: the strategy, where it came from (annotated, or the
        annotated op / dataset it was propagated from) and the alternatives considered, each
        with its communication (redistributions on the op's edges, by the cost model), compute
        and memory cost (`planner.Explanation`).

        Args:
            name: the op's name as `strategies` and the IR print it (``"relu/ReLU"``).

        Raises:
            ValueError: nothing planned yet, a plan not made by an automatic mode (semi_auto,
                a loaded file), or an unknown name (the message lists near names).

        Example:
            >>> print(parallel_net.explain("relu/ReLU"))  # seed 002
            relu/ReLU: ((2, 4),) (propagated from matmul/MatMul (annotated))
                ((2, 4),): comm 0.0 us, compute 32 elements, memory 256 B  <- chosen
                ...
        """
        plan = self.parallel_plan
        if plan is None or not plan.explained:
            why = "nothing planned yet" if plan is None else f"a {plan.mode} plan"
            raise ValueError(
                f"AutoParallel.explain: no explained plan ({why}); explanations come from "
                f"parallel_mode='sharding_propagation' or 'recursive_programming'"
            )
        if name not in plan.explained:
            near = difflib.get_close_matches(name, list(plan.explained), n=5, cutoff=0.3)
            raise ValueError(f"AutoParallel.explain: no op {name!r} in the plan; close: {near}")
        return str(plan.explained[name])
