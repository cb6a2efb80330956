"""semi_auto on one plan: capture -> plan -> apply -> run (`GraphRun`).

`GraphRun` serves every `AutoParallel` call in semi_auto (shardwise primitives, torch ops and
annotations alike; any dataset strategy):

- `GraphRun.plan` (first call): `_graph_capture.capture_plan` (through
  `_graph_plans.GraphPlans._capture_plan`, once the ranks agree on it): `planner.capture` of
  the train step (or the network's forward) on fake inputs of the global batch's shapes
  (`_call_io.global_inputs`), then `planner.plan_semi_auto`. ``sw.reshard`` (and so
  ``sw.shard``'s input and output strategies) is one op of the graph (`_shard.reshard_value`,
  through `_graph_capture.GraphSession`); ``sw.shard``'s op form on an ``nn.Linear`` /
  ``nn.Embedding`` annotates its node; parameter plans are collected during the capture. A
  call with other input shapes or ops is planned again (`GraphPlans._replan`; the plans are kept,
  looked up by `_call_io.input_shapes` and by the call's flags: `_variants.ByFlags`), and one
  after a parameter's dtype or device changed (only that plan kept: `GradPlanning._moved`).
- apply: split parameters cut to this rank's block (`_runtime.shard_parameters`, with the
  optimizer state already made); for every parameter in the layout the plan stores it in, the
  gradient hooks of `_grad_buckets.GradBuckets` (DDP-style 25 MB buckets, or as ``comm_fusion(...)``
  says: `_hsdp.gradient_buckets`; gradients the plan makes equal over some axes are not summed
  over them: `ParallelPlan.equal_grads`, the buckets made again for a plan variant whose
  differ, or when parameters were frozen or unfrozen: `_grad_plan.GradPlanning`); with
  ``hsdp()`` instead the optimizer-parallel engine (`_hsdp.start_engine`: shards at rest, each
  op gets a parameter's compute weight through `OptimizerParallel.compute`, gradients reduced
  into the shards).
- `GraphRun.__call__`: the call under a `PlanExecutor` (`_call_executor.call_executor`);
  ``full_batch`` inputs are first cut to this rank's rows by the plan's entry edges
  (`_call_io.cut_inputs`); a wrapped network's outputs leave as this rank's rows
  (``full_batch``: whole; `_call_io.rank_outputs`), and so do the tensors a train step
  returns (`_leaving.Leaving.step_outputs`); the tensor inputs that require grad get one
  device's gradient (`_input_grads`: a train step's through hooks for the call, a network's
  through a dividing autograd node); optimizer steps reach the executor through
  `_step_hooks.StepHooks`. A call that stops part way to be planned again (the step took
  another branch: `Replan`) runs anew from the state it started in: buffers, torch's and
  Python's RNG and the step's Python state other than its modules' and optimizers'
  (`planner._user_state.python_state`: a trainer's counter, a list, a generator object).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise._torch.module_state import own_buffers
from shardwise._transformers import same_masks
from shardwise.layout import TensorLayout
from shardwise.ops import Primitive
from shardwise.optim import FusionConfig, HsdpConfig, OptimizerParallel, OptimizerPlan
from shardwise.parallel._call_executor import call_executor, forward_marks, plan_table
from shardwise.parallel._call_io import (
    Cut,
    caller_inputs,
    cut_inputs,
    input_shapes,
    rank_outputs,
)
from shardwise.parallel._clip import clipping
from shardwise.parallel._context import get_auto_parallel_context
from shardwise.parallel._delayed import has_deferred
from shardwise.parallel._discover import agree_scalers, find_objects, hook_objects, noted_modules
from shardwise.parallel._errors import Replan, note_blocks, replanned_call_differs
from shardwise.parallel._executor import PlanExecutor
from shardwise.parallel._grad_buckets import GradBuckets
from shardwise.parallel._grad_plan import GradPlanning
from shardwise.parallel._graph_capture import GraphSession, check_plan_memory, eager
from shardwise.parallel._graph_plans import GraphPlans
from shardwise.parallel._held_clip import Blocks, watch_blocks
from shardwise.parallel._hsdp import (
    bucket_plans,
    optimizer_plan,
    start_engine,
)
from shardwise.parallel._input_grads import entry_gradients, input_gradients, mark_outputs
from shardwise.parallel._nested_encoders import nested_encoders
from shardwise.parallel._network_hooks import (
    NetworkHooks,
    check_annotations,
    noted_annotations,
)
from shardwise.parallel._node_table import NodeTable
from shardwise.parallel._observe import Planned, notify
from shardwise.parallel._ownership import cut_names, refuse_shared
from shardwise.parallel._rnn_checks import rows_hidden_checks
from shardwise.parallel._runtime import cut_optimizer_state, shard_parameters
from shardwise.parallel._shard import activate
from shardwise.parallel._spans import SpanHooks
from shardwise.parallel._step_hooks import StepHooks
from shardwise.parallel._variants import ByFlags, known_variant, snapshot
from shardwise.planner import ParallelPlan
from shardwise.planner._graph import SizeRead
from shardwise.planner._user_state import CALL_LIMIT, module_attributes, python_state

T = torch.Tensor


class GraphRun(StepHooks, GradPlanning, NetworkHooks, GraphPlans):
    """One network or train step run from its `ParallelPlan` (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        network: nn.Module,
        dataset: object,
        hsdp: HsdpConfig | None = None,
        fusion: FusionConfig | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        param_layouts: Mapping[str, TensorLayout] | None = None,
        mode: str = "semi_auto",
    ) -> None:
        self.fn = fn
        self.mode = mode  # (the planner: semi_auto or sharding_propagation)
        self.param_layouts = dict(param_layouts or {})  # (from a loaded strategy file)
        self.network = network
        self.dataset = dataset
        self.hsdp, self.fusion = hsdp, fusion
        self.engine: OptimizerParallel | None = None
        self.clip_watch: Blocks | None = None  # (without hsdp: torch's clipping outside a call)
        self.module_form = fn is network
        self.parallel_plan: ParallelPlan | None = None
        self.templates: list[tuple[Any, Any]] = []
        self.hooks: list[Any] = []
        self.undo: list[Callable[[], None]] = []  # (GradScalers given one verdict: `plan`)
        self.grad_plan: OptimizerPlan | None = None  # the gradient AllReduce buckets
        self.grads: GradBuckets | None = None
        self.grads_equal: dict[str, tuple[int, ...]] = {}  # the plan's equal gradients they use
        self.trainable: tuple[bool, ...] = ()  # which parameters required gradients then
        self.watched: list[nn.Parameter] = []  # (the network's parameters, listed once)
        self.optimizers = list(optimizers)
        self.session = GraphSession(network)
        self.executor: PlanExecutor | None = None  # during a call
        # what the next backward's gradients are still divided by (`set_divisor`)
        self.divisor = comm.get_group_size()
        self.plans: list[tuple[ParallelPlan, list[tuple[Any, Any]]]] = []  # every plan made
        self.by_flags = ByFlags()  # (the plan each call's flags last ran)
        self.tables: dict[int, tuple[ParallelPlan, NodeTable]] = {}  # by id of the plan
        self.capturing = False
        self.blocks = False  # (parameters stored as blocks or shards: `_network_hooks`)
        self.modules: list[nn.Module] = []  # (the network's holding buffers when planning)
        self.all_modules: list[nn.Module] = []  # (`noted_modules`, at each plan)
        self.rnns: list[nn.RNNBase] = []  # (its recurrent modules: `_rnn_checks`)
        self.objects: list[Any] = []  # (the Python state a call changes: `python_state`)
        self.size_reads: dict[int, tuple[SizeRead, ...]] = {}  # (the last plan's: `_errors`)
        watch_all = bool(get_auto_parallel_context("watch_every_op"))
        self.spans = SpanHooks(network, lambda: self.executor, enabled=not watch_all)

    def plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ParallelPlan:
        """Capture and plan with the global shapes of this call's inputs (the ops, the
        parameters' storage and the gradient / optimizer-parallel buckets), and apply the plan
        to the parameters."""
        graph, plan = self._capture_plan(args, kwargs)
        stored = plan.param_layouts()
        buckets = optimizer_plan(
            self.network, plan.matrix, stored, self.hsdp, self.fusion, plan.equal_grads
        )
        plan = dataclasses.replace(plan, buckets=bucket_plans(buckets, plan.matrix))
        refuse_shared(self.network, None if self.module_form else self.fn, cut_names(plan))
        check_plan_memory(plan, buckets, self.network, self.optimizers)
        notify(Planned(plan, graph, self.network, tuple(self.optimizers), buckets, self.hsdp))
        self.parallel_plan = plan
        self.size_reads = {id(plan): graph.size_reads}
        self.templates = [(n.args, dict(n.kwargs)) for n in graph.nodes]
        self.plans = [(plan, self.templates)]
        self.tables = {}
        self.modules = [m for m in self.network.modules() if own_buffers(m)]
        loaded = find_objects(self.fn)
        self.all_modules = noted_modules(self.network, loaded)
        self.rnns = [m for m in self.network.modules() if isinstance(m, nn.RNNBase)]
        self.objects = [  # (not modules and optimizers: a note of theirs costs ~4 us each)
            o
            for o in [*loaded, *hook_objects(self.network.modules())]
            if not isinstance(o, nn.Module | torch.optim.Optimizer)
        ]
        for m in self.network.modules():
            if isinstance(m, Primitive):
                self.hooks.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
                self.hooks.append(m.register_forward_hook(self._leave))
        self._step_hooks()
        self.blocks = self.hsdp is not None or any(v[0].used_axes() for v in stored.values())
        if self.blocks:  # (each rank's GradScaler sees its blocks: one verdict for all ranks)
            self.undo += agree_scalers(self.fn)
        self.hooks.append(self.network.register_forward_pre_hook(self._network_called))
        self.annotated = noted_annotations(self.network, graph)  # (changed later: refused)
        if has_deferred(self.network):  # built in sw.no_init_parameters(): materialize now
            shard_parameters(self.network, stored)
        else:  # each split parameter (and state an optimizer made already) cut to its block
            split = {n: v for n, v in stored.items() if v[0].used_axes()}
            shard_parameters(self.network, split)
            cut_optimizer_state(self.network, self.optimizers, split)
            self._cut_later(split)  # (an optimizer not found by then: `StepHooks`)
        if self.hsdp is not None:
            # optimizer parallel: shards at rest, gathered compute weights, reduced gradients
            started = (plan.matrix, buckets, self.clip_args, lambda: self.divisor)
            self.engine = start_engine(self.network, *started, self.module_form)
            self.trainable = self._trainable()
        else:
            self._buckets(plan, buckets)
            self.clip_watch = watch_blocks(self.network, self.clip_args)  # (clipping outside)
        self.kinds = self._kinds()  # (changed later: planned again, `_moved`)
        return plan

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.spans.remove()
        if self.engine is not None:
            self.engine.remove()
        for undo in self.undo:
            undo()
        self.undo = []

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self._call(args, kwargs)
        except RuntimeError as e:  # (torch's own errors; shardwise's are ValueErrors)
            note_blocks(e, self.parallel_plan, self.network)
            raise

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        check_annotations(self.network, self.annotated)
        self._replaced(args, kwargs)  # (parameters replaced since: planned again, `_grad_plan`)
        if (moved := self._moved()) is not None:  # (parameters of another dtype: `_grad_plan`)
            self._replan(args, kwargs, moved)
            self._moved_planned()
        shapes = input_shapes(self.dataset, comm.get_group_size(), args, kwargs)
        plan = self.parallel_plan
        assert plan is not None
        picked = self.by_flags.pick(args, kwargs, shapes, self.plans)  # (``train=False``)
        if picked is not None:
            self.parallel_plan, self.templates = picked
        elif shapes != dict(plan.input_shapes):  # another input signature: its plan, or a new one
            found = [(p, t) for p, t in self.plans if dict(p.input_shapes) == shapes]
            if found:
                self.parallel_plan, self.templates = found[-1]
            else:
                self._replan(args, kwargs, f"inputs of global shapes {shapes}")
        self._check_trainable()
        state, python = snapshot(self.modules), python_state(self.objects, CALL_LIMIT, False)
        attributes = module_attributes(self.all_modules)
        try:
            return self._run(args, kwargs)
        except Replan as e:
            state.restore()  # (what the stopped attempt changed: buffers, the RNG, Python state)
            python()
            attributes()
            stop = e
        ran = self.parallel_plan  # (the plan the stopped attempt ran)
        assert ran is not None
        variant = known_variant(self.plans, ran, shapes, stop)
        if variant is not None:
            self.parallel_plan, self.templates = variant
            try:
                return self._run(args, kwargs)
            except Replan as e:  # (a known plan that parts from the call later on)
                state.restore()
                python()
                attributes()
                stop = e
        self._replan(args, kwargs, str(stop))
        try:
            return self._run(args, kwargs)
        except Replan as e:  # (the new plan was captured from this very call)
            assert self.parallel_plan is not None
            reads = self.size_reads.get(id(self.parallel_plan), ())
            raise replanned_call_differs(self.parallel_plan, e, reads) from None

    def _executor(
        self,
        plan: ParallelPlan,
        call: tuple[tuple[Any, ...], dict[str, Any]],
        on_start: Callable[[], None],
        on_end: Callable[[], None],
    ) -> PlanExecutor:
        """An executor of `plan` for one call with arguments `call` (the plan's `NodeTable`
        worked out once per plan: `plan_table`), telling this run each backward's divisor."""
        table = plan_table(self.tables, plan, self.templates, self.dataset)
        hooks, buckets = (on_start, on_end), self.grads is not None
        run = (self.network, self.engine, hooks, buckets, bool(self.hsdp), self.set_divisor)
        return call_executor(plan, table, call, *run, params=self.param_names)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call under a `PlanExecutor` of the current plan, noted for its flags."""
        plan = self.parallel_plan
        assert plan is not None
        inside = bool(plan.roots)  # (the backward runs in the call, else after it)
        caller = (args, kwargs)  # (their autograd nodes are the caller's: `mark_outputs`)
        if not inside:  # (a network, a function without backward: `_input_grads`)
            args, kwargs = entry_gradients(plan, args, kwargs, self.dataset)
        given = (args, kwargs)  # (as the caller holds them: `input_gradients`)
        cuts: list[Cut] = []  # (``full_batch``: inputs cut to this rank's rows, leaving whole)
        if self.dataset == "full_batch":
            (args, kwargs), cuts = cut_inputs(plan, args, kwargs)
        if self.grads is not None:
            self._buckets(plan)  # (a plan variant with other equal gradients)
            self.grads.drop_unfinished()  # (a backward that raised)
        if not inside:  # (the caller's backward, from every rank's copy: N)
            self.set_divisor(comm.get_group_size())
        engine = self.engine
        # (level 3's saved-tensor hooks, around the whole call: `saved_tensors`)
        saved = nullcontext() if engine is None else engine.saved_tensors()
        marks = forward_marks(engine, self._check_trainable)  # (frozen in the step: checked)
        executor = self.executor = self._executor(plan, (args, kwargs), *marks)
        executor.note_inputs(cuts)
        hooks: list[Any] = []
        try:
            if inside:  # (only while the step's own backward runs)
                hooks = input_gradients(
                    plan,
                    *given,
                    self.dataset,
                    lambda: executor.in_backward > 0,
                    lambda: self.divisor,
                )
            clip = clipping(*self.clip_args())
            rnn = rows_hidden_checks(self.rnns)  # (an initial state made whole)
            nested = nested_encoders()  # (torch's nested-tensor path: its result)
            with saved, executor, activate(self.session), clip, eager(), same_masks(), rnn, nested:
                out = self.fn(*args, **kwargs)
        except Replan:
            if engine is not None and executor.cursor:
                engine.end_forward()  # (the forward stops here; the call runs anew)
            raise
        finally:
            self.executor = None
            for h in hooks:
                h.remove()
        executor.check_done("the end of the call")
        executor.store_buffers()  # (re-assigned buffers made whole: `_leaving`)
        if executor.done and executor.table.candidates is None:
            self.spans.update(executor.table)
        if self.module_form:
            out = rank_outputs(plan, out, self.dataset)
        else:
            out = executor.step_outputs(caller_inputs(out, cuts))  # (rows: `_leaving`)
        mark_outputs(out, caller)  # (an input computed from them: `_input_grads`)
        # (the next call with its flags; the plan as run, which `_check_trainable` at the
        # forward's start may have replaced)
        self.by_flags.note(*caller, (self.parallel_plan or plan, self.templates))
        return out
