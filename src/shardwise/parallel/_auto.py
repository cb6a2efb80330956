"""`AutoParallel`: the semi_auto operator-parallel wrapper (a network or a train-step function).

Every call (any dataset strategy) runs from one `ParallelPlan` (`_graph_run.GraphRun`): the
first call (or `AutoParallel.plan` given this rank's inputs) captures every op of the network
or train step (shardwise primitives, torch ops, ``sw.shard`` / ``sw.reshard`` annotations),
plans it (`planner.plan_semi_auto`), cuts the parameters to their stored blocks and starts
either optimizer parallel (`_hsdp.start_engine`) or the gradient buckets
(`_runtime.GradBuckets`); every call then runs under the plan executor
(`_executor.PlanExecutor`), and a call that runs other ops or shapes is planned again.
`_plan_graph` also writes the reports.

The primitive runtime serves `AutoParallel.plan(shapes=...)` (global shapes, no inputs):
step 1 (`_plan.trace_calls`, `_plan.plan_network`), step 2 (`_runtime.shard_parameters`), then
optimizer parallel or the gradient hooks; every call then runs step 3 in a session
(`_call.CallRuntime`): hooks on the primitives redistribute each input from the state it has
(`_tracker.Tracker`) to the layout its plan wants, run the primitive on the local blocks, apply
the plan's collectives and record the output layouts; unannotated torch ops run data parallel
(`_torchops.DataParallelOps`).
``parallel_mode="data_parallel"`` instead runs `optim.DataParallelRunner` (`_data_parallel`).

Inputs follow MindSpore's convention in both forms (`_step.arriving_input`): under the default
``"data_parallel"`` dataset strategy each rank passes its own rows of the global batch, under
``"full_batch"`` the whole global batch, under per-input entries its block. A wrapped network's
outputs leave as this rank's rows (the whole output under ``"full_batch"``); a wrapped train
step runs unchanged on what the rank passed and returns its (replicated) loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise import report, runtime
from shardwise.layout import TensorLayout
from shardwise.ops import Primitive
from shardwise.optim import (
    DataParallelRunner,
    OptimizerParallel,
    OptimizerPlan,
    check_fusion,
    check_hsdp,
)
from shardwise.parallel._call import CallRuntime
from shardwise.parallel._context import (
    check_device_num,
    get_auto_parallel_context,
    resolve_parallel_mode,
)
from shardwise.parallel._discover import find_referenced, pick_network
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._graph_run import GraphRun
from shardwise.parallel._hsdp import gradient_buckets, settings_from_context, start_engine
from shardwise.parallel._local import Masked
from shardwise.parallel._ownership import take_over
from shardwise.parallel._plan import NetworkPlan, Shape, plan_network, trace_calls
from shardwise.parallel._runtime import (
    GradBuckets,
    cut_optimizer_state,
    replicated_layout,
    shard_parameters,
)
from shardwise.parallel._shard import Declared, activate
from shardwise.parallel._step import (
    DatasetStrategy,
    arriving_input,
    check_dataset_strategy,
)
from shardwise.parallel._strategy_files import StrategyFiles
from shardwise.parallel._torchops import DataParallelOps
from shardwise.parallel._tracker import State, Tracker, input_matrices, layout_of
from shardwise.planner import ParallelPlan
from shardwise.planner._graph import op_strategy


def _global_shape(x: torch.Tensor, world: int) -> Shape:
    """The global shape of a data-parallel input of which `x` is this rank's rows."""
    return (int(x.shape[0]) * world, *(int(s) for s in x.shape[1:]))


def _on(state: State, plan: NetworkPlan) -> State:
    """A tracked state for the reports: layouts moved onto the plan's matrix."""
    return state if isinstance(state, str) else layout_of(state, plan.matrix, state.ndim)


def _tensor_indices(inputs: Sequence[Any]) -> tuple[list[int], int]:
    """Each input's position among the tensor inputs, and how many there are."""
    index, n = [], 0
    for x in inputs:
        index.append(n)
        n += isinstance(x, torch.Tensor)
    return index, n


def _memory_estimate(network: nn.Module, plan: NetworkPlan) -> list[runtime.TensorEstimate]:
    """This rank's tensors for `runtime.check_memory`: parameters (planned ones' local blocks,
    the others whole), their gradients, and every primitive output's local block."""
    out, grads = [], []
    for name, p in network.named_parameters():
        shape = tuple(int(s) for s in p.shape)
        if name in plan.params:
            layout, shape = plan.params[name]
            shape = layout.local_shape(shape)
        out.append(runtime.TensorEstimate(name, shape, p.dtype))
        if p.requires_grad:
            grads.append(runtime.TensorEstimate(f"{name}.grad", shape, p.dtype, "gradients"))
    acts = [
        runtime.TensorEstimate(f"{cp.plan.who} output {k}", local, torch.float32, "activations")
        for cp in plan.calls
        for k, local in enumerate(cp.plan.local_output_shapes())
    ]
    return out + grads + acts


def _refuse_op_form(network: nn.Module) -> None:
    """The primitive runtime does not run ``sw.shard``'s op form (`GraphRun` does)."""
    for name, m in network.named_modules():
        if op_strategy(m) is not None:
            raise UnsupportedParallelError(
                f"sw.shard on {name} ({type(m).__name__}): the op form (a strategy for the "
                f"module's op) runs from the captured plan, which AutoParallel.plan(shapes=...) "
                f"does not make; pass this rank's inputs (plan(x, y)) or let the first call plan"
            )


class AutoParallel(CallRuntime, StrategyFiles):
    """Run a network operator-parallel as its primitives' strategies say (semi_auto).

    Args:
        network_or_step: a module (shardwise primitives, torch modules and ops, annotated
            with ``shard()`` / ``sw.shard`` or not), or a train-step function
            ``step(*inputs)`` calling such a network, ``loss.backward()`` and
            ``optimizer.step()`` and returning the loss.
        parallel_mode: ``"semi_auto"`` or ``"data_parallel"`` (the whole network on every
            rank, `optim.DataParallelRunner`; with `hsdp`, owner update + broadcast); default
            (None): from `set_auto_parallel_context` (``SEMI_AUTO_PARALLEL`` or the default
            ``STAND_ALONE``: semi_auto; ``DATA_PARALLEL``; strategy search modes raise
            `UnsupportedParallelError`). The context's ``dataset_strategy`` is read here
            too (``dataset_strategy()`` overrides it) and its ``device_num`` checked at plan time.
        network: the network of a train step (default: the referenced module with parameters).
        optimizer: the optimizer(s) of a train step (default: those it references), or of a
            wrapped module (needed in data_parallel mode).

    Inputs, in both forms (MindSpore's convention, `dataset_strategy`): by default
    (``"data_parallel"``) each rank passes its own rows of the global batch, e.g. from a dataset
    read with ``num_shards=n, shard_id=rank``; the global batch is the ranks' rows in rank order.
    Under ``"full_batch"`` each rank passes the whole global batch. A wrapped module returns
    this rank's rows of the output (``"full_batch"``: the whole output); the loss built on them
    must be the same value on every rank (e.g. ``AllReduce()(loss) / n`` on rows). A wrapped
    train step runs unchanged on what the rank passed and returns the loss of the global
    batch, the same on every rank. The gradient hooks
    treat the n replicas as one loss (sum over replicas, then / n). After ``backward`` each
    parameter holds this rank's block and that block's gradient, so any torch.optim optimizer
    (built before or after the first call) updates the blocks.

    Limits: once planned the network only runs through the wrapper; a call that runs other
    ops (before its first backward) or passes other shapes is planned again; ops that change
    after a backward within one call are refused. `plan(shapes=...)` (global shapes instead of
    inputs) uses the primitive runtime, which refuses unannotated torch ops outside
    `_torchops.OP_KINDS`.
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
            modules, found = find_referenced(network_or_step)
            network = network if network is not None else pick_network(modules)
            self.optimizers = list(given) if given is not None else found
        self.network = network
        self.parallel_mode = parallel_mode
        self.network_plan: NetworkPlan | None = None
        self._dataset: DatasetStrategy = get_auto_parallel_context("dataset_strategy")
        self._tracker = Tracker()
        self._ops: DataParallelOps | None = None
        self._cursor = 0
        self._planning = False
        self._fixup: Masked | None = None
        self._declared = Declared()
        self._hsdp, self._fusion = settings_from_context()
        self._engine: OptimizerParallel | None = None
        self._grads: GradBuckets | None = None
        self._grad_plan: OptimizerPlan | None = None
        self._layouts: dict[int, tuple[TensorLayout, Shape]] = {}
        self._saved = ExitStack()
        self._runner: DataParallelRunner | None = None
        self._fusion_dict: dict[str, Any] = dict(get_auto_parallel_context("comm_fusion"))
        self._hooks: list[Any] = []
        self._superseded = False
        self._graph: GraphRun | None = None
        self._graph_planning = False
        self._loaded: tuple[ParallelPlan, str] | None = None
        self._loaded_params: tuple[int, dict[str, Any], str] | None = None
        take_over(network, self)
        if parallel_mode == "semi_auto":
            self._hooks = [
                network.register_forward_pre_hook(self._enter_network),
                network.register_forward_hook(self._leave_network),
            ]

    def dataset_strategy(self, strategy: DatasetStrategy) -> AutoParallel:
        """How each input of the wrapped call is split.

        Args:
            strategy: how each rank's inputs relate to the global batch, the same for a
                wrapped module and a wrapped train step: ``"data_parallel"`` (the default:
                each rank passes its own rows; the global batch is the ranks' rows in rank
                order), ``"full_batch"`` (each rank passes the whole global batch; each
                consumer takes its share), or one entry per tensor input, each rank passing its
                block of that layout: split counts such as ``((2, 1), (2,))`` (the repeat
                factor appended on the right when they use fewer devices than the job: ranks
                0-3 pass the first half of the rows on 8 ranks) or Layout calls
                ``(layout("dp", "None"), layout("dp"))``.

        Returns:
            self.

        Example:
            >>> AutoParallel(train_step).dataset_strategy(((4, 1, 1, 1), (4,)))
        """
        self._dataset = check_dataset_strategy(strategy)
        return self

    def hsdp(
        self, shard_size: int = -1, threshold: float = 64, optimizer_level: str = "level1"
    ) -> AutoParallel:
        """Turn on optimizer parallel (MindSpore's hsdp; see docs/optim.md).

        Args:
            shard_size: ranks one parameter is sharded over; -1: its whole data-parallel group
                (the ranks holding the same op-level block); else a divisor of it (the shards
                are then kept equal across the groups by an AllReduce).
            threshold: KB; smaller parameter blocks are not sharded.
            optimizer_level: ``"level1"`` (optimizer state and update sharded; weights gathered
                once per step and kept for forward and backward; full gradients kept until the
                optimizer step, then reduce-scattered), ``"level2"`` (gradients reduce-scattered
                in backward as soon as a bucket is ready), ``"level3"`` (also weights gathered
                again in backward instead of being kept).

        Returns:
            self.

        Example:
            >>> AutoParallel(train_step, parallel_mode="semi_auto").hsdp(optimizer_level="level2")
        """
        if self.network_plan is not None or self._runner is not None:
            raise ValueError("AutoParallel.hsdp: call it before the first step (already planned)")
        self._hsdp = check_hsdp(shard_size, threshold, optimizer_level)
        return self

    def comm_fusion(self, config: Mapping[str, Any]) -> AutoParallel:
        """Bucket gradient / weight collectives by size or index instead of by fusion id.

        Without this call (and without the context's ``comm_fusion``) the gradient AllReduces
        go in buckets of at most 25 MB (DDP's default); with it, a kind without a mode fuses by
        ``comm_fusion`` id (``set_comm_fusion``; id 0: one collective per parameter), and
        ``{"openstate": False}`` gives one collective per parameter.

        Args:
            config: ``{"allreduce" | "allgather" | "reducescatter": {"mode": "auto" | "size" |
                "index", "config": ...}}``: ``auto`` = 64 MB buckets, ``size`` = ``config`` MB,
                ``index`` (allreduce only) = parameter indices where a new bucket starts.

        Returns:
            self.

        Example:
            >>> parallel_net.comm_fusion({"allreduce": {"mode": "size", "config": 32}})
        """
        if self.network_plan is not None or self._runner is not None:
            raise ValueError("AutoParallel.comm_fusion: call it before the first step")
        self._fusion = check_fusion(config)
        self._fusion_dict = dict(config)
        return self

    @property
    def optimizer_plan(self) -> OptimizerPlan | None:
        """The optimizer-parallel plan (None before planning): with `hsdp`, which parameters
        shard and the buckets of their collectives; without, nothing sharded and the gradient
        AllReduce buckets (25 MB by default, or as `comm_fusion` says)."""
        if self._engine is not None:
            return self._engine.plan
        if self._graph is not None:  # (a network run from its ParallelPlan)
            return self._graph.grad_plan
        return self._grad_plan

    def plan(
        self,
        *inputs: torch.Tensor,
        shapes: Sequence[Shape] | None = None,
        states: Sequence[State] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> NetworkPlan:
        """Plan with the global shapes of the network's inputs and shard the parameters (once).

        Given `inputs` alone (this rank's inputs, as a call passes them), the call is captured
        and planned as the first call would be (`ParallelPlan`, `parallel_plan`), and its
        stored parameter layouts are returned. `shapes` (global shapes) / `states` use the
        primitive runtime: `shapes` default: these inputs as this rank's rows of data-parallel
        inputs; `states`: how each input arrives (for the reports; default: as the dataset
        strategy names); `dtypes`: the inputs' dtypes for the meta trace (default: those of
        `inputs`)."""
        if self.network_plan is not None:
            return self.network_plan
        if shapes is None and states is None and self._graph is None:
            self._graph = self._plan_graph(tuple(inputs), {})
            assert self.network_plan is not None
            return self.network_plan
        world = comm.get_group_size()
        if shapes is None:
            shapes = [_global_shape(x, world) for x in inputs]
        if dtypes is None and inputs:
            dtypes = [x.dtype for x in inputs]
        try:
            check_device_num(world)
            _refuse_op_form(self.network)
            plan = self._make_plan(world, shapes, states, dtypes)
            runtime.check_memory(_memory_estimate(self.network, plan), "AutoParallel.plan")
        except BaseException:
            self.remove()  # the network works on its own again; the wrapper is spent
            raise
        shard_parameters(self.network, plan.params)
        if self._hsdp is not None:
            self._engine = start_engine(self.network, plan, self._hsdp, self._fusion)
            report.dump_optimizer(self._engine.plan, plan)
        else:
            cut_optimizer_state(self.network, self.optimizers, plan.params)
            layouts = {**self._replicated_params(plan), **plan.params}
            buckets = gradient_buckets(self.network, layouts, self._fusion)
            self._grads = GradBuckets(self.network, buckets)
            self._hooks += self._grads.handles
            self._grad_plan = buckets
            report.dump_optimizer(buckets, plan)
        self._layouts = {
            id(self.network.get_parameter(n)): v
            for n, v in {**self._replicated_params(plan), **plan.params}.items()
        }
        for m in self.network.modules():
            if isinstance(m, Primitive):
                self._hooks.append(m.register_forward_pre_hook(self._before, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._after))
        self.network_plan = plan
        return plan

    def _make_plan(
        self,
        world: int,
        shapes: Sequence[Shape],
        states: Sequence[State] | None,
        dtypes: Sequence[torch.dtype] | None,
    ) -> NetworkPlan:
        """Trace on meta tensors (collecting `sw.shard` / `sw.reshard` declarations), plan, and
        write the reports."""
        self._planning = True
        self._declared = Declared()
        try:
            with activate(self):
                calls = trace_calls(self.network, shapes, dtypes)
            params = self._declared.parameter_layouts(self.network)
            extra = input_matrices(self._tracker) + self._declared.matrices
            plan = plan_network(calls, world, extra, params)
            named = self._dataset if isinstance(self._dataset, str) else "data_parallel"
            arrive = named if states is None else [_on(st, plan) for st in states]
            report.dump_plan(plan, self.network, shapes, arrive, input_dtypes=dtypes)
        finally:
            self._planning = False
        return plan

    def remove(self) -> None:
        """Take the wrapper's hooks off the network (it then runs on its own, unsharded if
        planning failed). Called when planning fails."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._engine is not None:
            self._engine.remove()
        if self._runner is not None:
            self._runner.remove()

    def _replicated_params(self, plan: NetworkPlan) -> dict[str, tuple[Any, Shape]]:
        """The parameters no primitive consumes (unannotated modules): whole on every rank."""
        return {
            name: (replicated_layout(plan.matrix, p.dim()), tuple(int(s) for s in p.shape))
            for name, p in self.network.named_parameters()
            if name not in plan.params
        }

    @property
    def has_run(self) -> bool:
        """Whether the wrapper has planned (semi_auto) or run (data_parallel)."""
        return self.network_plan is not None or self._runner is not None or self._graph is not None

    @property
    def parallel_plan(self) -> ParallelPlan | None:
        """The `ParallelPlan` the wrapper runs (None before the first call, or in the primitive
        runtime, after `plan(shapes=...)`: see `network_plan`)."""
        return None if self._graph is None else self._graph.parallel_plan

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._superseded:
            raise ValueError(
                f"AutoParallel: a newer AutoParallel wraps {type(self.network).__name__}; call "
                "that one"
            )
        if self.parallel_mode == "data_parallel":
            return self._data_parallel(*inputs, **kwargs)
        if self._graph is None and self.network_plan is None:
            self._graph = self._plan_graph(inputs, kwargs)
        if self._graph is not None:
            return self._graph(inputs, kwargs)
        if kwargs:
            raise UnsupportedParallelError(
                "AutoParallel: after plan(shapes=...) the network takes positional tensors; "
                "plan with this rank's inputs (plan(x, y)) to call it with keywords"
            )
        with self._session():
            index, n = _tensor_indices(inputs)
            for x, i in zip(inputs, index, strict=True):
                arriving_input(x, self._dataset, self._tracker, i, n)
            if self.train_step is not None:
                return self.train_step(*inputs)
            out = self.network(*inputs)
            self._pause(1)
            return self._to_output(out, whole=self._dataset == "full_batch")

    def _plan_graph(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> GraphRun:
        """Capture and plan the network (or train step) on its first call."""
        fn = self.train_step if self.train_step is not None else self.network
        run = GraphRun(
            fn, self.network, self._dataset, self._hsdp, self._fusion, optimizers=self.optimizers
        )
        self._graph_planning = True
        try:
            check_device_num(comm.get_group_size())
            plan = run.plan(inputs, kwargs)
        except BaseException:
            self.remove()
            raise
        finally:
            self._graph_planning = False
        try:
            self._check_loaded(run)
        except BaseException:
            run.remove()
            self.remove()
            raise
        self._hooks += run.hooks
        self._engine = run.engine
        # (the stored parameter layouts as a NetworkPlan, for the optimizer report and for
        # `network_plan` readers; its primitive calls are in the ParallelPlan)
        stored = plan.param_layouts()
        self.network_plan = NetworkPlan(plan.matrix, (), stored)
        report.dump_parallel_plan(plan)
        if run.engine is not None:
            report.dump_optimizer(run.engine.plan, self.network_plan)
        elif run.grad_plan is not None:  # (the gradient AllReduce buckets)
            report.dump_optimizer(run.grad_plan, self.network_plan)
        return run

    def _data_parallel(self, *inputs: Any, **kwargs: Any) -> Any:
        """``parallel_mode="data_parallel"``: the whole network on every rank, gradients
        all-reduced at the optimizer step; with `hsdp`, each parameter updated by its owner and
        broadcast (seed 001's data-parallel variant, `optim.DataParallelRunner`)."""
        if self._runner is None:
            hsdp = self._hsdp
            self._runner = DataParallelRunner(
                self.network,
                self.optimizers,
                train_step=self.train_step,
                parallel_optimizer=hsdp is not None,
                threshold_kb=hsdp.threshold if hsdp is not None else 64,
                fusion=self._fusion_dict or None,
                dataset_strategy=self._dataset,
            )
        return self._runner(*inputs, **kwargs)
