"""The plans of a `_graph_run.GraphRun`, each captured from a call (`GraphPlans`, mixed into
`GraphRun`):

- `GraphPlans._capture_plan`: `_graph_capture.capture_plan` of the call (the train step or
  the network's forward on fake inputs of the global shapes, then the planner of the
  wrapper's mode; with ``hsdp()`` the step checked for what optimizer parallel refuses:
  `_hsdp.check_step`; without, an ``LBFGS`` / ``Adafactor`` over split parameters refused:
  `_step_hooks.refuse_coupled`), once the ranks are found to agree on it
  (`_same_inputs.check_ranks_agree`: the ranks meant to pass the same inputs did, and every
  rank made rank 0's plan or none raised); `GraphPlans._capturing` marks the capture running.
- `GraphPlans._replan`: a call that ran other ops or passed other shapes than the plan's
  planned again (announced to the other ranks first, `_same_inputs.announce_planning`: a rank
  that kept its plan is named in a ValueError instead of a wait until the timeout), the
  parameters kept as the first plan (or the one given) stores them; its
  gradient buckets made for the new plan's equal gradients (``hsdp()``: the engine's, as the
  first plan made them); a plan equal to a known one captured with the same sizes
  (`_variants.same_sizes`) reused, a new one checked for memory
  (`_graph_capture.check_plan_memory`), kept with the others (`_variants.keep_few`), its
  annotated modules noted (`_network_hooks.noted_annotations`) and its reports written.

`GraphRun.plan` (the first call) uses `_capture_plan` too, and applies its plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import report
from shardwise.communication import recorder
from shardwise.layout import TensorLayout
from shardwise.optim import FusionConfig, HsdpConfig, OptimizerParallel
from shardwise.parallel._discover import find_objects, noted_modules
from shardwise.parallel._graph_capture import GraphSession, capture_plan, check_plan_memory
from shardwise.parallel._hsdp import bucket_plans, check_step, gradient_buckets
from shardwise.parallel._network_hooks import Annotation, noted_annotations
from shardwise.parallel._node_table import NodeTable
from shardwise.parallel._same_inputs import announce_planning, check_ranks_agree, same_inputs
from shardwise.parallel._step_hooks import refuse_coupled, stepping_in_stack
from shardwise.parallel._variants import keep_few, same_sizes
from shardwise.planner import Graph, ParallelPlan, regathered_params


class GraphPlans:
    """Capturing and planning again, for `GraphRun` (which sets the attributes below)."""

    fn: Callable[..., Any]
    network: nn.Module
    dataset: object
    mode: str
    param_layouts: dict[str, TensorLayout]
    optimizers: list[torch.optim.Optimizer]
    session: GraphSession
    hsdp: HsdpConfig | None
    fusion: FusionConfig | None
    engine: OptimizerParallel | None
    capturing: bool
    parallel_plan: ParallelPlan | None
    templates: list[tuple[Any, Any]]
    plans: list[tuple[ParallelPlan, list[tuple[Any, Any]]]]
    tables: dict[int, tuple[ParallelPlan, NodeTable]]
    annotated: list[Annotation]

    if TYPE_CHECKING:

        @property
        def stored_plan(self) -> ParallelPlan: ...

    def _capture_plan(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], stored: ParallelPlan | None = None
    ) -> tuple[Graph, ParallelPlan]:
        """`capture_plan` of this call (`stored`: a plan whose parameter storage it keeps),
        once the ranks are found to agree on it (`check_ranks_agree`: the ranks meant to pass
        the same inputs did, and every rank made rank 0's plan or none raised)."""
        named = same_inputs(self.dataset, args, kwargs)  # (before the capture reads them)
        try:
            with self._capturing():
                graph, plan = capture_plan(
                    self.fn,
                    self.network,
                    self.session,
                    self.dataset,
                    self.param_layouts,
                    args,
                    kwargs,
                    stored,
                    self.mode,
                    self.optimizers,
                )
            if self.hsdp is not None:
                check_step(graph, self.optimizers, self.network)  # (in-place writes, LBFGS)
            else:  # (LBFGS / Adafactor over split parameters; the stored plan's splits)
                found = [*self.optimizers, *stepping_in_stack()]
                refuse_coupled(found, self.network, stored or plan)
        except Exception as e:  # (told to the other ranks, which would wait for this one)
            check_ranks_agree(self.dataset, args, kwargs, named, e)
            raise
        check_ranks_agree(self.dataset, args, kwargs, named, plan)
        return graph, plan

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False

    def _replan(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str,
        storage: ParallelPlan | None = None,
    ) -> None:
        """The network ran other ops than the plan's (`reason`): a plan for this call, kept
        with the others (the parameters stay stored as the first plan, or `storage`, stores
        them)."""
        first = self.stored_plan
        announce_planning(args, kwargs)  # (ranks that keep their plan never do: named then)
        graph, plan = self._capture_plan(args, kwargs, stored=storage or first)
        if self.hsdp is None:  # (the first plan's parameters, this plan's equal gradients)
            stored = (first if storage is None else plan).param_layouts()
            made = gradient_buckets(self.network, stored, self.fusion, plan.equal_grads)
            plan = dataclasses.replace(plan, buckets=bucket_plans(made, plan.matrix))
        else:  # (the engine's shards stay as the first plan made them)
            assert self.engine is not None
            made = self.engine.plan
            plan = dataclasses.replace(plan, buckets=first.buckets)
        self.all_modules = noted_modules(self.network, find_objects(self.fn))  # (one added since)
        captured = [(n.args, dict(n.kwargs)) for n in graph.nodes]
        for known, templates in self.plans:  # (the same plan captured with other sizes: a new one)
            if known == plan and same_sizes(templates, captured):
                self.parallel_plan, self.templates = known, templates
                return
        check_plan_memory(plan, made, self.network, self.optimizers)  # (another batch size...)
        self.templates = captured
        self.parallel_plan = plan
        self.plans.append((plan, self.templates))
        keep_few(self.plans, self.tables, reason)
        known_ids = {id(a[0]) for a in self.annotated}
        self.annotated += [
            a for a in noted_annotations(self.network, graph) if id(a[0]) not in known_ids
        ]
        recorder.mark(f"planned again: the network called {reason}")
        variant = report.next_variant()
        report.dump_parallel_plan(plan, variant=variant)
        again = regathered_params(plan)  # (level 3: the buckets gathered again in backward)
        report.dump_optimizer(made, plan.matrix, variant=variant, regathered=again)
