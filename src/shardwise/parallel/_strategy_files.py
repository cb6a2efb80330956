"""The strategy-file methods of `AutoParallel` (`StrategyFiles`): save the `ParallelPlan` or the
parameters' layouts as JSON, and load them back, checked against the network at the first call
(`_check_loaded`, called by `AutoParallel._plan_graph`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise import planner
from shardwise.parallel._graph_run import GraphRun
from shardwise.planner import ParallelPlan


class StrategyFiles:
    """Mixed into `AutoParallel`; state set by its ``__init__``."""

    _loaded: tuple[ParallelPlan, str] | None
    _loaded_params: tuple[int, dict[str, Any], str] | None

    if TYPE_CHECKING:  # AutoParallel's properties

        @property
        def has_run(self) -> bool: ...

        @property
        def parallel_plan(self) -> ParallelPlan | None: ...

    def save_operator_strategy_file(self, path: str | Path) -> None:
        """Write the plan (every op's strategy, every redistribution, the parameters' layouts)
        to `path` as JSON.

        Args:
            path: the file to write.

        Raises:
            ValueError: nothing planned yet (call the wrapper once first), or a network run by
                the primitive runtime (``plan(shapes=...)`` with global shapes: its plan
                is `network_plan`).

        Example:
            >>> parallel_step.save_operator_strategy_file("plan.json")
        """
        planner.save_operator_strategy_file(self._saved_plan("save_operator_strategy_file"), path)

    def save_param_strategy_file(self, path: str | Path) -> None:
        """Write every parameter's storage layout to `path` as JSON (see
        `save_operator_strategy_file`)."""
        planner.save_param_strategy_file(self._saved_plan("save_param_strategy_file"), path)

    def load_operator_strategy_file(self, path: str | Path) -> Any:
        """Run the plan saved in `path` instead of planning: at the first call the network is
        captured and the file checked against it (device count, every op and shape, every
        parameter); the first mismatch raises `planner.StrategyFileError`.

        Returns:
            self.
        """
        if self.has_run:
            raise ValueError(
                "AutoParallel.load_operator_strategy_file: call it before the first step"
            )
        self._loaded = (planner.load_operator_strategy_file(path), str(path))
        return self

    def load_param_strategy_file(self, path: str | Path) -> Any:
        """Check at the first call that the parameters' layouts saved in `path` are this plan's
        (same device count, names, shapes and layouts); a mismatch raises
        `planner.StrategyFileError` naming the first one.

        Returns:
            self.
        """
        if self.has_run:
            raise ValueError("AutoParallel.load_param_strategy_file: call it before the first step")
        self._loaded_params = (*planner.load_param_strategy_file(path), str(path))
        return self

    def _saved_plan(self, who: str) -> ParallelPlan:
        plan = self.parallel_plan
        if plan is None:
            raise ValueError(
                f"AutoParallel.{who}: no ParallelPlan yet: call the wrapper once first (a "
                f"network planned by plan(shapes=...) runs the "
                f"primitive runtime, whose plan is network_plan)"
            )
        return plan

    def _check_loaded(self, run: GraphRun) -> None:
        """Check the loaded strategy files against the fresh plan and run the loaded plan."""
        fresh = run.parallel_plan
        assert fresh is not None
        if self._loaded is not None:
            loaded, path = self._loaded
            planner.check_matches(loaded, fresh, path)
            if loaded.params != fresh.params:
                raise planner.StrategyFileError(
                    f"{path}: the parameters' layouts differ from this plan's; storing "
                    f"parameters in other layouts is not supported for this network yet"
                )
            run.parallel_plan = loaded
            run.plans = [(loaded, run.templates)]
        if self._loaded_params is not None:
            device_num, params, path = self._loaded_params
            if device_num != fresh.device_num:
                raise planner.StrategyFileError(
                    f"{path}: saved for {device_num} devices, the job has {fresh.device_num}"
                )
            planner.check_params(params, fresh.params, path)
            for name, p in params.items():
                if p.layout.dims != fresh.params[name].layout.dims:
                    raise planner.StrategyFileError(
                        f"{path}: parameter {name!r} is stored as {p} in the file, as "
                        f"{fresh.params[name]} by this plan"
                    )
