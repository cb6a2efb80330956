"""semi_auto for networks of plain torch ops: capture -> plan -> apply -> run, on one plan.

`GraphRun` serves `AutoParallel` when the network holds no shardwise primitive, with a
``"data_parallel"`` or ``"full_batch"`` dataset strategy:

- `GraphRun.plan` (first call): `planner.capture` of the train step (or the network's forward)
  on fake inputs of the global batch's shapes, then `planner.plan_semi_auto`. ``sw.reshard``
  (and so ``sw.shard``'s input and output strategies) is one op of the graph
  (`_shard.reshard_value`, through `_GraphSession`); ``sw.shard``'s op form on an
  ``nn.Linear`` / ``nn.Embedding`` annotates its node; parameter plans are collected during
  the capture.
- apply: split parameters cut to this rank's block (`_runtime.shard_parameters`, with the
  optimizer state already made); for every parameter in the layout the plan stores it in, the
  gradient hooks of `_runtime.GradBuckets` (DDP-style 25 MB buckets, or as ``comm_fusion(...)``
  says: `_hsdp.gradient_buckets`); with ``hsdp()`` instead the optimizer-parallel engine
  (`_hsdp.start_engine`: shards at rest, each op gets a parameter's compute weight through
  `OptimizerParallel.compute`, gradients reduced into the shards).
- `GraphRun.__call__`: the call under a `PlanExecutor`; ``full_batch`` inputs are first cut to
  this rank's rows by the plan's entry edges; a wrapped network's outputs leave as this rank's
  rows (``full_batch``: whole).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardwise import communication as comm
from shardwise.communication import recorder
from shardwise.ops import Primitive
from shardwise.optim import FusionConfig, HsdpConfig, OptimizerParallel, OptimizerPlan
from shardwise.parallel._delayed import has_deferred
from shardwise.parallel._executor import PlanExecutor, move
from shardwise.parallel._hsdp import gradient_buckets, start_engine
from shardwise.parallel._plan import NetworkPlan
from shardwise.parallel._runtime import GradBuckets, cut_optimizer_state, shard_parameters
from shardwise.parallel._shard import Declared, Entry, activate, reshard_value
from shardwise.planner import ParallelPlan, Placed, capture, plan_semi_auto
from shardwise.planner._capture import input_key
from shardwise.planner._plan import replicated
from shardwise.planner._semi_auto import data_parallel
from shardwise.redistribution import redistribute

T = torch.Tensor


class _GraphSession:
    """The `_shard.Session` of a captured network: ``sw.reshard`` becomes the graph op
    `reshard_value` (recorded by the capture, carried out by the executor), and parameter plans
    are collected while capturing."""

    def __init__(self, network: nn.Module) -> None:
        self.network = network
        self.declared: Declared | None = Declared()

    def reshard(self, t: T, entry: Entry) -> T:
        return reshard_value(t, entry)

    def declare_parameters(self, owner: nn.Module | None, plan: Mapping[str, Entry]) -> None:
        if self.declared is not None:
            self.declared.add(self.network, owner, plan)


def eligible(network: nn.Module, dataset: object) -> bool:
    """Whether `GraphRun` can serve this network (see the module docstring)."""
    if dataset not in ("data_parallel", "full_batch"):
        return False
    return not any(isinstance(m, Primitive) for m in network.modules())


def _global(x: Any, world: int, dataset: object) -> Any:
    """A meta tensor of `x`'s global shape (rows of all ranks under data_parallel)."""
    if not isinstance(x, T):
        return x
    shape = list(x.shape)
    if dataset == "data_parallel" and shape:
        shape[0] *= world
    return torch.empty(shape, dtype=x.dtype, device="meta")


class GraphRun:
    """One network or train step run from its `ParallelPlan` (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        network: nn.Module,
        dataset: object,
        hsdp: HsdpConfig | None = None,
        fusion: FusionConfig | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        self.fn = fn
        self.network = network
        self.dataset = dataset
        self.hsdp, self.fusion = hsdp, fusion
        self.engine: OptimizerParallel | None = None
        self.module_form = fn is network
        self.parallel_plan: ParallelPlan | None = None
        self.templates: list[tuple[Any, Any]] = []
        self.hooks: list[Any] = []
        self.grad_plan: OptimizerPlan | None = None  # the gradient AllReduce buckets
        self.grads: GradBuckets | None = None
        self.optimizers = list(optimizers)
        self.session = _GraphSession(network)

    def plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ParallelPlan:
        """Capture and plan with the global shapes of this call's inputs, and apply the plan
        to the parameters."""
        world = comm.get_group_size()
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, T)]
        device = tensors[0].device if tensors else torch.device("cpu")
        g_args, g_kwargs = pytree.tree_map(
            lambda x: _global(x, world, self.dataset), (args, kwargs)
        )
        with activate(self.session), comm.plain_tensors():
            graph = capture(self.fn, *g_args, networks=[self.network], device=device, **g_kwargs)
            assert self.session.declared is not None
            declared = self.session.declared.parameter_layouts(self.network)
            self.session.declared = None
            plan = plan_semi_auto(
                graph,
                world,
                dataset=str(self.dataset),
                param_layouts={n: layout for n, (layout, _) in declared.items()},
            )
        self.parallel_plan = plan
        self.templates = [(n.args, dict(n.kwargs)) for n in graph.nodes]
        stored = plan.param_layouts()
        if has_deferred(self.network):  # built in sw.no_init_parameters(): materialize now
            shard_parameters(self.network, stored)
        else:  # each split parameter (and state an optimizer made already) cut to its block
            split = {n: v for n, v in stored.items() if v[0].used_axes()}
            shard_parameters(self.network, split)
            cut_optimizer_state(self.network, self.optimizers, split)
        if self.hsdp is not None:
            # optimizer parallel: shards at rest, gathered compute weights, reduced gradients
            as_network_plan = NetworkPlan(plan.matrix, (), stored)
            self.engine = start_engine(self.network, as_network_plan, self.hsdp, self.fusion)
        else:
            self.grad_plan = gradient_buckets(self.network, stored, self.fusion)
            self.grads = GradBuckets(self.network, self.grad_plan)
            self.hooks += self.grads.handles
        return plan

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.engine is not None:
            self.engine.remove()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        plan = self.parallel_plan
        assert plan is not None
        if self.dataset == "full_batch":
            args, kwargs = self._cut_inputs(plan, args, kwargs)
        if self.grads is not None:
            self.grads.drop_unfinished()  # (a backward that raised)
        params = {id(p): n for n, p in self.network.named_parameters()}
        engine = self.engine
        saved = ExitStack()

        def forward_starts() -> None:  # (optimizer parallel level 3: tokens for saved weights)
            if engine is not None:
                saved.enter_context(engine.saved_tensors())
            recorder.mark("forward")

        def forward_done() -> None:  # (optimizer parallel level 3: free the gathered weights)
            saved.close()
            if engine is not None:
                engine.end_forward()
            recorder.mark("forward done")

        executor = PlanExecutor(
            plan,
            params,
            param_value=None if engine is None else engine.compute,
            templates=self.templates,
            on_end=forward_done,
            on_start=forward_starts,
        )
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(leaf, T):
                executor.inputs[id(leaf)] = f"input:{input_key(pytree.keystr(path))}"
        try:
            with executor, activate(self.session):
                out = self.fn(*args, **kwargs)
        finally:
            saved.close()
        executor.check_done("the end of the call")
        return self._outputs(plan, out) if self.module_form else out

    def _cut_inputs(
        self, plan: ParallelPlan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``full_batch``: each input the plan cuts at entry, as this rank's rows."""
        entry = {e.value.removeprefix("input:"): e for e in plan.edges if e.consumer == -2}
        flat, spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = []
        for path, leaf in flat:
            edge = entry.get(input_key(pytree.keystr(path)))
            leaves.append(leaf if edge is None or not isinstance(leaf, T) else move(leaf, edge))
        out: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_unflatten(leaves, spec)
        return out

    def _outputs(self, plan: ParallelPlan, out: Any) -> Any:
        """A wrapped network's outputs as this rank's rows (``full_batch``: whole)."""
        leaves, spec = pytree.tree_flatten(out)
        placed = iter(plan.outputs)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, T):
                continue
            src: Placed = next(placed)
            ndim = leaf.dim()
            gshape = tuple(int(s) * src.layout.split_count(d) for d, s in enumerate(leaf.shape))
            whole = self.dataset == "full_batch" or ndim == 0 or gshape[0] % plan.device_num
            m = src.layout.matrix
            want = replicated(m, ndim) if whole else data_parallel(m, ndim)
            if src.layout != want.layout:
                leaves[i] = redistribute(leaf, src.layout, want.layout, gshape)
        return pytree.tree_unflatten(leaves, spec)
