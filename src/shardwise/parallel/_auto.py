"""`AutoParallel`: the operator-parallel wrapper (a network or a train-step function).

Every call (any dataset strategy) runs from one `ParallelPlan` (`_graph_run.GraphRun`): the
first call (or `AutoParallel.plan`, given this rank's inputs or the inputs' global shapes)
captures every op of the network or train step (shardwise primitives, torch ops, ``sw.shard`` /
``sw.reshard`` annotations), plans it (`planner.plan_semi_auto`; in sharding_propagation
`planner.plan_sharding_propagation`, in recursive_programming
`planner.plan_recursive_programming`), cuts the parameters to their
stored blocks and starts either optimizer parallel (`_hsdp.start_engine`) or the gradient
buckets (`_grad_buckets.GradBuckets`); every call then runs under the plan executor
(`_executor.PlanExecutor`), and a call that runs other ops or shapes is planned again.
`_plan_graph` also writes the reports (`_reading.dump_first_plan`).
``parallel_mode="data_parallel"`` instead runs `optim.DataParallelRunner`
(`_data_parallel_mode.start_runner`). The settings a wrapper takes before its first call
(``dataset_strategy``, ``hsdp``, ``comm_fusion``) are `_wrapper_settings.WrapperSettings`'s;
reading the plan, strategy files and gradient clipping are those of its other bases
(`_reading.PlanReading`, `_strategy_files.StrategyFiles`, `_clip.Clipping`).

Inputs follow MindSpore's convention: under the default ``"data_parallel"`` dataset strategy
each rank passes its own rows of the global batch, under ``"full_batch"`` the whole global
batch, under per-input entries its block (`_call_io.local_inputs` turns global shapes into
such inputs). A wrapped network's outputs leave as this rank's rows (the whole output under
``"full_batch"``); a wrapped train step runs unchanged on what the rank passed and returns its
(replicated) loss, and every other tensor the plan made leaves as a network's outputs do
(`_leaving`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.optim import DataParallelRunner, OptimizerParallel, OptimizerPlan
from shardwise.parallel._call_io import float_shapes_hint, local_inputs
from shardwise.parallel._clip import DATA_PARALLEL, Clipping, clipping
from shardwise.parallel._compiled import uncompiled, warn_compiled
from shardwise.parallel._context import (
    check_device_num,
    get_auto_parallel_context,
    resolve_parallel_mode,
)
from shardwise.parallel._data_parallel_mode import start_runner
from shardwise.parallel._discover import find_referenced, pick_network
from shardwise.parallel._errors import refuse_lazy
from shardwise.parallel._graph_run import GraphRun
from shardwise.parallel._hsdp import settings_from_context, watch_closures
from shardwise.parallel._nested import running
from shardwise.parallel._ownership import refuse_shared, stored, take_over
from shardwise.parallel._reading import PlanReading, dump_first_plan
from shardwise.parallel._step import DatasetStrategy
from shardwise.parallel._strategy_files import StrategyFiles
from shardwise.parallel._wrapper_settings import WrapperSettings
from shardwise.planner import FakeKernelError, ParallelPlan


class AutoParallel(nn.Module, WrapperSettings, StrategyFiles, PlanReading, Clipping):
    """Run a network operator-parallel as its strategies say, or as the automatic planners
    choose (semi_auto, sharding_propagation, recursive_programming).

    Args:
        network_or_step: a module (shardwise primitives, torch modules and ops, annotated
            with ``shard()`` / ``sw.shard`` or not), or a train-step function
            ``step(*inputs)`` calling such a network, ``loss.backward()`` and
            ``optimizer.step()`` and returning the loss.
        parallel_mode: ``"semi_auto"`` (annotated ops keep their strategies, the others run
            data parallel), ``"sharding_propagation"`` (annotated ops keep theirs, the others
            take the strategies that make the graph's redistributions cheapest:
            `planner.plan_sharding_propagation`), ``"recursive_programming"`` (every strategy
            and the device matrix chosen by the plan's total cost, annotations as
            constraints: `planner.plan_recursive_programming`) or ``"data_parallel"`` (the
            whole network on every rank, `optim.DataParallelRunner`; with `hsdp`, owner update
            + broadcast); a `ParallelMode` (MindSpore's names) is read as the context's;
            default (None): from `set_auto_parallel_context`
            (``SEMI_AUTO_PARALLEL`` or the default ``STAND_ALONE``: semi_auto;
            ``AUTO_PARALLEL``: its ``search_mode``; ``DATA_PARALLEL``; the search mode
            ``dynamic_programming`` raises `UnsupportedParallelError`). The context's
            ``dataset_strategy`` is read here too (``dataset_strategy()`` overrides it) and
            its ``device_num`` checked at plan time.
        network: the network of a train step (default: the referenced module with parameters).
        optimizer: the optimizer(s) of a train step (default: those it references), or of a
            wrapped module (needed in data_parallel mode).

    Inputs, in both forms (MindSpore's convention, `dataset_strategy`): by default
    (``"data_parallel"``) each rank passes its own rows of the global batch, e.g. from a dataset
    read with ``num_shards=n, shard_id=rank``; the global batch is the ranks' rows in rank order.
    Under ``"full_batch"`` each rank passes the whole global batch. A wrapped module returns
    this rank's rows of the output (``"full_batch"``: the whole output); a loss it computes
    itself (a floating 0-d output: ``out.loss``, a bare loss) is the global batch's, the same on
    every rank (data_parallel mode: the ranks' mean, its gradient this rank's, averaged at the
    optimizer step); a loss built on its rows outside it must be the same value on every rank
    (e.g. ``AllReduce()(loss) / n`` on rows; data_parallel mode: each rank's own). A wrapped
    train step runs unchanged on what the rank passed and returns the loss of the global
    batch, the same on every rank; any other tensor it returns that the plan's ops made
    (``(loss, logits.detach())``) leaves as a wrapped module's outputs do, whatever the plan
    holds it as (a partial sum, a model-parallel split); an op after ``loss.backward()`` on
    such a value, other than an elementwise one, is refused. The gradient hooks
    treat the n replicas as one loss (sum over replicas, then / n). After ``backward`` each
    parameter holds this rank's block and that block's gradient, so any torch.optim optimizer
    (built before or after the first call) updates the blocks.

    Limits: once planned the network only runs through the wrapper; a call that runs other
    ops (before its first backward) or passes other shapes is planned again; ops that change
    after a backward within one call are refused.
    """

    _shardwise_wrapper = True  # skipped when a train step's modules are looked up

    def __init__(
        self,
        network_or_step: nn.Module | Callable[..., Any],
        parallel_mode: str | None = None,
        network: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        parallel_mode = resolve_parallel_mode(parallel_mode)
        self.train_step: Callable[..., Any] | None = None
        given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        if isinstance(network_or_step, nn.Module):
            network = network_or_step
            self.optimizers: list[torch.optim.Optimizer] = list(given or [])
        else:
            self.train_step = network_or_step
            modules: list[nn.Module] = []
            found: list[torch.optim.Optimizer] = []
            if network is None or given is None:  # (what the step's code loads)
                modules, found = find_referenced(network_or_step)
            network = network if network is not None else pick_network(modules)
            self.optimizers = list(given) if given is not None else found
        self.network = network
        self.parallel_mode = parallel_mode
        self._dataset: DatasetStrategy = get_auto_parallel_context("dataset_strategy")
        self._hsdp, self._fusion = settings_from_context(parallel_mode)
        if self._hsdp is not None:  # (a first call inside a closure: `stepping_over`)
            watch_closures(self)
        self._runner: DataParallelRunner | None = None
        self._undo_scalers: list[Callable[[], None]] = []
        self._fusion_dict: dict[str, Any] = dict(get_auto_parallel_context("comm_fusion"))
        self._hooks: list[Any] = []
        self._superseded = False
        self.removed = False  # (`remove` called: the wrapper runs nothing more)
        self._graph: GraphRun | None = None
        self._loaded: tuple[ParallelPlan, str] | None = None
        self._loaded_params: tuple[int, dict[str, Any], str] | None = None
        self._ckpt_config: dict[str, Any] = get_auto_parallel_context("strategy_ckpt_config")
        take_over(network, self)
        if self._ckpt_config.get("load_file") and parallel_mode != "data_parallel":
            self.load_param_strategy_file(self._ckpt_config["load_file"])

    @property
    def rows_per_rank(self) -> bool:
        """Whether each rank passes its own part of the global batch (any dataset strategy but
        ``"full_batch"``): a module-form wrapper's outputs are then this rank's rows, and a loss
        computed from them outside the wrapper is this rank's."""
        return self._dataset != "full_batch"

    @property
    def optimizer_plan(self) -> OptimizerPlan | None:
        """The optimizer-parallel plan (None before planning): with `hsdp`, which parameters
        shard and the buckets of their collectives; without, nothing sharded and the gradient
        AllReduce buckets (25 MB by default, or as `comm_fusion` says)."""
        if self._graph is None:
            return None
        engine = self._engine
        return engine.plan if engine is not None else self._graph.grad_plan

    @property
    def _engine(self) -> OptimizerParallel | None:
        """The optimizer-parallel engine (with `hsdp`, once planned)."""
        return None if self._graph is None else self._graph.engine

    def plan(
        self,
        *inputs: Any,
        shapes: Sequence[Sequence[int]] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> ParallelPlan:
        """Capture and plan the call as its first call would, and cut the parameters (once).

        Args:
            inputs: this rank's inputs, as a call passes them (positional).
            shapes: instead of `inputs`, the global shapes of the call's tensor inputs
                (positional); each rank's inputs are then taken to be its share under the
                dataset strategy (its rows under ``"data_parallel"``).
            dtypes: the dtypes of the `shapes` inputs (default: float32).

        Returns:
            The `ParallelPlan` the wrapper runs (the same as `parallel_plan`).

        Raises:
            ValueError: both or neither of `inputs` and `shapes`; shapes the dataset strategy
                does not divide; an invalid plan (`planner.PlanError`).

        Example:
            >>> plan = AutoParallel(net).plan(shapes=[(32, 784)])
            >>> print(plan)  # doctest: +SKIP
        """
        if self.parallel_mode == "data_parallel":
            raise ValueError("AutoParallel.plan: data_parallel runs as is: nothing to plan")
        if self._graph is None:
            if (shapes is None) == (not inputs):
                raise ValueError(
                    "AutoParallel.plan: pass this rank's inputs (plan(x, y)) or their global "
                    "shapes (plan(shapes=[(32, 784), (32,)])), not both"
                )
            if shapes is not None:
                world = comm.get_group_size()
                inputs = local_inputs(shapes, dtypes, self._dataset, world)
            try:
                self._graph = self._plan_graph(tuple(inputs), {})
            except FakeKernelError as e:  # (its type, notes and traceback kept)
                if shapes is not None and dtypes is None:
                    e.args = (f"{e}\n{float_shapes_hint(shapes)}",)
                raise
        plan = self._graph.parallel_plan
        assert plan is not None
        return plan

    def remove(self) -> None:
        """Take the wrapper's hooks off the network (it then runs on its own, unsharded if
        planning failed). Called when planning fails."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._graph is not None:
            self._graph.remove()
        if self._runner is not None:
            self._runner.remove()
        for undo in self._undo_scalers:
            undo()
        self._undo_scalers = []
        self.removed = self.has_run  # (after a failed first plan: nothing ran)

    @property
    def has_run(self) -> bool:
        """Whether the wrapper has planned (semi_auto) or run (data_parallel)."""
        return self._runner is not None or self._graph is not None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (torch.compile of the wrapper: `_compiled`)
            warn_compiled(self)
        return self._call(*inputs, **kwargs)

    @uncompiled
    def _call(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._superseded:
            raise ValueError(
                f"AutoParallel: a newer AutoParallel wraps {type(self.network).__name__}; call "
                "that one (one network is run by one wrapper: to train and evaluate it, wrap "
                "one step that branches on a flag, step(x, y, train=False); docs/parallel.md, "
                "'Training and evaluation in one step')"
            )
        if not self.has_run:
            step = self.train_step
            refuse_lazy([self.network, *(find_referenced(step)[0] if step is not None else [])])
        with running(self, planned=self.parallel_mode != "data_parallel"):
            if self.parallel_mode == "data_parallel":
                return self._data_parallel(*inputs, **kwargs)
            if self._graph is None:
                self._graph = self._plan_graph(inputs, kwargs)
            return self._graph(inputs, kwargs)

    def _plan_graph(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphRun:
        """Capture and plan the network (or train step) on its first call."""
        fn = self.train_step if self.train_step is not None else self.network
        world = comm.get_group_size()
        try:
            check_device_num(world)
            refuse_shared(self.network, self.train_step)  # (stored cut by another wrapper)
            layouts = self._loaded_layouts(self.network, world)
        except BaseException:
            self.remove()
            raise
        run = GraphRun(
            fn,
            self.network,
            self._dataset,
            self._hsdp,
            self._fusion,
            optimizers=self.optimizers,
            param_layouts=layouts,
            # (a loaded operator file is the plan: checked against a semi_auto one, no search)
            mode="semi_auto" if self._loaded is not None else self.parallel_mode,
        )
        try:
            run.plan(inputs, kwargs)
            self._check_loaded(run)
        except BaseException:
            run.remove()
            self.remove()
            raise
        self._hooks += run.hooks
        stored(self.network, run)
        plan = run.parallel_plan
        assert plan is not None
        dump_first_plan(run, plan)
        save = self._ckpt_config.get("save_file")
        if save:  # (set_auto_parallel_context(strategy_ckpt_config=...)); MindSpore's default
            self._save_params(plan, save, self._ckpt_config.get("only_trainable_params", True))
        return run

    def _data_parallel(self, *inputs: Any, **kwargs: Any) -> Any:
        """``parallel_mode="data_parallel"``: the whole network on every rank
        (`_data_parallel_mode.start_runner`)."""
        if self._runner is None:
            self._runner, self._undo_scalers = start_runner(
                self.network,
                self.optimizers,
                self.train_step,
                self._hsdp,
                self._fusion_dict,
                self._dataset,
            )
        with clipping(None, DATA_PARALLEL):
            return self._runner(*inputs, **kwargs)
