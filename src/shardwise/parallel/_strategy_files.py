"""The strategy-file methods of `AutoParallel` (`StrategyFiles`): save the `ParallelPlan` or the
parameters' layouts as JSON, and load them back, checked against the network at the first call
(`_check_loaded`, called by `AutoParallel._plan_graph`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise import planner
from shardwise.layout import TensorLayout
from shardwise.parallel._graph_run import GraphRun
from shardwise.parallel._hsdp import bucket_plans, optimizer_plan, sparse_weights
from shardwise.parameter import tied_names
from shardwise.planner import BucketPlan, ParallelPlan
from shardwise.planner._recorders import dtype_name


class StrategyFiles:
    """Mixed into `AutoParallel`; state set by its ``__init__``."""

    network: nn.Module
    parallel_mode: str
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
            ValueError: nothing planned yet (call the wrapper or its ``plan`` once first).

        Example:
            >>> parallel_step.save_operator_strategy_file("plan.json")
        """
        planner.save_operator_strategy_file(self._saved_plan("save_operator_strategy_file"), path)

    def save_param_strategy_file(
        self, path: str | Path, only_trainable_params: bool = False
    ) -> None:
        """Write every parameter's storage layout to `path` as JSON (see
        `save_operator_strategy_file`).

        Args:
            path: the file to write (atomically: every rank may write the same path).
            only_trainable_params: only the parameters that require a gradient (MindSpore's
                ``strategy_ckpt_config`` option; loading such a file plans the others).

        Example:
            >>> parallel_step.save_param_strategy_file("params.json")
        """
        plan = self._saved_plan("save_param_strategy_file")
        self._save_params(plan, path, only_trainable_params)

    def _save_params(self, plan: ParallelPlan, path: str | Path, only_trainable: bool) -> None:
        names = None
        if only_trainable:
            names = {n for n, p in self.network.named_parameters() if p.requires_grad}
        planner.save_param_strategy_file(plan, path, names, tied_names(self.network))

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
        """Store the parameters as `path` says: at the first call the network is planned with
        each parameter in the file's layout (MindSpore's ``strategy_ckpt_load_file``), after
        checking the file against the job (device count) and the network (every parameter's
        name and global shape); the first mismatch raises `planner.StrategyFileError`.

        Returns:
            self.
        """
        if self.has_run:
            raise ValueError("AutoParallel.load_param_strategy_file: call it before the first step")
        self._loaded_params = (*planner.load_param_strategy_file(path), str(path))
        return self

    def _saved_plan(self, who: str) -> ParallelPlan:
        plan = self.parallel_plan
        if plan is None and self.parallel_mode == "data_parallel":
            raise ValueError(
                f"AutoParallel.{who}: parallel_mode='data_parallel' makes no operator plan "
                "(every rank holds the whole network and each parameter whole); strategy files "
                "describe the plans of semi_auto and auto_parallel"
            )
        if plan is None:
            raise ValueError(
                f"AutoParallel.{who}: no ParallelPlan yet: call the wrapper (or its plan()) "
                f"once first"
            )
        return plan

    def _loaded_layouts(self, network: nn.Module, world: int) -> dict[str, TensorLayout]:
        """The parameters' storage layouts the loaded files set (the operator strategy file's,
        else the parameter strategy file's; empty without either), checked first against the
        job's size and the network's parameters.

        Raises:
            planner.StrategyFileError: another device count; for a parameter strategy file a
                missing, extra or resized parameter (the first one named).
        """
        params: dict[str, Any]
        if self._loaded is not None:
            plan, path = self._loaded
            device_num, params = plan.device_num, dict(plan.params)
        elif self._loaded_params is not None:
            device_num, params, path = self._loaded_params
        else:
            return {}
        planner.check_device_count(device_num, world, path)
        shapes = {n: tuple(int(s) for s in p.shape) for n, p in network.named_parameters()}
        if self._loaded is None:
            dtypes = {n: dtype_name(p.dtype) for n, p in network.named_parameters()}
            planner.check_params(params, shapes, path, _frozen(network), dtypes)
        # (an operator strategy file's mismatches are named op by op after capture)
        return {n: p.layout for n, p in params.items() if tuple(p.shape) == shapes.get(n)}

    def _check_loaded(self, run: GraphRun) -> None:
        """Check the loaded strategy files against the fresh plan and run the loaded plan."""
        fresh = run.parallel_plan
        assert fresh is not None
        if self._loaded is not None:
            loaded, path = self._loaded
            planner.check_matches(loaded, fresh, path)
            if loaded.params != fresh.params:  # (planned with the file's storage: equal)
                name = next(n for n in fresh.params if loaded.params[n] != fresh.params[n])
                was, now = loaded.params[name], fresh.params[name]
                if (was.layout, was.shape) == (now.layout, now.shape):
                    raise planner.dtype_mismatch(path, name, was.dtype, now.dtype)
                raise planner.StrategyFileError(
                    f"{path}: parameter {name!r} is stored as {loaded.params[name]} in the "
                    f"file but can only be stored as {fresh.params[name]} on this job's device "
                    f"matrix {fresh.matrix}"
                )
            if not loaded.roots:  # (a file saved before plans kept them: this step's)
                loaded = dataclasses.replace(loaded, roots=fresh.roots)
            elif loaded.roots != fresh.roots:
                raise planner.StrategyFileError(
                    f"{path}: the train step's backward starts from "
                    f"{', '.join(map(str, loaded.roots))} in the file, from "
                    f"{', '.join(map(str, fresh.roots)) or 'nothing the capture saw'} in this "
                    f"step; the file belongs to another train step"
                )
            expected = _buckets_for(run, loaded, fresh)
            if loaded.buckets and loaded.buckets != expected:
                _check_frozen(loaded.frozen, fresh.frozen, path)  # (the likelier cause)
            # (this network's frozen parameters, the buffers this step re-assigns)
            loaded = dataclasses.replace(loaded, frozen=fresh.frozen, set_buffers=fresh.set_buffers)
            if not loaded.buckets:  # (a file without buckets: this job's)
                loaded = dataclasses.replace(loaded, buckets=expected)
            elif _sparse_apart(loaded.buckets, expected, sparse_weights(run.network)):
                loaded = dataclasses.replace(loaded, buckets=expected)  # (an older file)
            elif loaded.buckets != expected:
                pairs = itertools.zip_longest(loaded.buckets, expected)
                k, (a, b) = next((k, ab) for k, ab in enumerate(pairs) if ab[0] != ab[1])
                raise planner.StrategyFileError(
                    f"{path}: the gradient / optimizer buckets differ from the ones this job "
                    f"makes for the file's plan (bucket {k}: {_bucket(a)} in the file, "
                    f"{_bucket(b)} here); use the same hsdp() / comm_fusion() settings as the "
                    "saving job"
                )
            # (checkpointed regions are the step's, not a strategy: this capture's)
            loaded = dataclasses.replace(loaded, regions=fresh.regions)
            planner.check_decisions(loaded, fresh, path)
            run.parallel_plan = loaded
            run.plans = [(loaded, run.templates)]
        if self._loaded_params is not None:  # (stored as the file says, or as the ops file)
            _, params, path = self._loaded_params
            shapes = {n: p.shape for n, p in fresh.params.items()}
            planner.check_params(params, shapes, path, _frozen(run.network))
            for name, p in params.items():
                mine = fresh.params[name].layout
                if (p.layout.dims, p.layout.groups) != (mine.dims, mine.groups):
                    raise planner.StrategyFileError(
                        f"{path}: parameter {name!r} is stored as {p} in the file, as "
                        f"{fresh.params[name]} by this plan (the operator strategy file's)"
                    )


def _buckets_for(
    run: GraphRun, loaded: ParallelPlan, fresh: ParallelPlan
) -> tuple[BucketPlan, ...]:
    """The gradient / optimizer buckets this job's hsdp() / comm_fusion() settings make for the
    file's plan `loaded` (its parameters stored as in `fresh`, this job's plan of the network):
    they depend on the ops' strategies only through the gradients the plan makes equal
    (`ParallelPlan.equal_grads`), which a plan by propagation or the search may make on other
    axes than the semi_auto plan `fresh` (a head it splits over every axis: none)."""
    if dict(loaded.equal_grads) == dict(fresh.equal_grads):
        return fresh.buckets
    stored = fresh.param_layouts()
    made = optimizer_plan(
        run.network, fresh.matrix, stored, run.hsdp, run.fusion, loaded.equal_grads
    )
    return bucket_plans(made, fresh.matrix)


def _frozen(network: nn.Module) -> set[str]:
    """The parameters of `network` that need no gradient (a file saved with
    ``only_trainable_params`` has no layout for them: they are planned as usual)."""
    return {n for n, p in network.named_parameters() if not p.requires_grad}


def _few(names: Sequence[str], limit: int = 4) -> str:
    """`names` quoted, at most `limit` of them (a GPT-2 has ~150 parameters)."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _sparse_apart(
    loaded: Sequence[planner.BucketPlan], fresh: Sequence[planner.BucketPlan], sparse: set[str]
) -> bool:
    """Whether the buckets differ only by `sparse` weights (``nn.Embedding(sparse=True)``)
    this job puts in buckets of their own: a file saved before they were (they shared the
    dense buckets), which loads with this job's buckets."""
    if not sparse:
        return False

    def dense(buckets: Sequence[planner.BucketPlan]) -> list[planner.BucketPlan]:
        kept = [
            dataclasses.replace(b, params=tuple(p for p in b.params if p not in sparse))
            for b in buckets
        ]
        return [b for b in kept if b.params]

    return dense(loaded) == dense(fresh)


def _bucket(bucket: planner.BucketPlan | None) -> str:
    """`bucket` as its str, its parameter list cut to a few names."""
    if bucket is None:
        return "(none)"
    if len(bucket.params) <= 4:
        return str(bucket)
    head = str(dataclasses.replace(bucket, params=bucket.params[:4]))
    return f"{head} and {len(bucket.params) - 4} more"


def _check_frozen(saved: Sequence[str], here: Sequence[str], path: str) -> None:
    """`StrategyFileError` naming the parameters whose ``requires_grad`` differs from the
    file's ``frozen`` list (the job's gradient buckets then differ from the file's)."""
    trainable = [n for n in saved if n not in here]
    if trainable:
        raise planner.StrategyFileError(
            f"{path}: parameter {_few(trainable)} requires grad in this network but was frozen "
            "(requires_grad=False) in the saving job (the file's 'frozen' list): set the same "
            f"requires_grad as the saving job (requires_grad_(False) on {trainable[0]!r})"
        )
    frozen = [n for n in here if n not in saved]
    if frozen:
        raise planner.StrategyFileError(
            f"{path}: parameter {_few(frozen)} is frozen (requires_grad=False) in this network "
            "but required grad in the saving job (not in the file's 'frozen' list): set the "
            f"same requires_grad as the saving job (requires_grad_(True) on {frozen[0]!r}); a "
            "file written before plans listed frozen parameters has no such list: then its "
            "buckets differ for another reason (use the saving job's hsdp() / comm_fusion())"
        )
