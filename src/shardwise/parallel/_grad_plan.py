"""The gradient side of a `_graph_run.GraphRun`: its gradient buckets and clipping arguments.

- `GradPlanning._buckets`: the gradient AllReduce buckets (`_grad_buckets.GradBuckets`) for the
  first plan's parameters, made again for a plan variant whose equal gradients differ, or when
  parameters were frozen or unfrozen since (`_trainable_changed`, which also puts the new
  buckets and frozen parameters into the plan; with ``hsdp()``, whose shards are planned once,
  a parameter unfrozen that did not require a gradient at the first call is refused,
  `_hsdp.check_unfrozen`; one frozen since and unfrozen again trains on).
- `GradPlanning._moved`: a parameter's dtype or device changed since the plan (``net.to(
  torch.float64)``, ``.half()``, ``p.data = ...`` of another dtype): the run plans the call
  again and keeps only that plan (the plans before describe the old dtypes: their bytes, their
  buckets), and `_buckets` makes the gradient buckets again (their flat buffers, and the
  gradient-storing autograd node torch makes anew for the parameter); with ``hsdp()``, whose
  shards are planned once, refused (`_hsdp.check_kinds`).
- `GradPlanning._replaced`: parameters replaced since the plan (``net.head = nn.Linear(...)``,
  ``load_state_dict(..., assign=True)``; found by `_replaced.registrations`): the call is
  planned again with their shapes and layouts taken anew (`_replaced.fresh_storage`), a new
  value of a split parameter's global shape cut to this rank's block, and the buckets made again
  for the new objects; with ``hsdp()`` refused (`_replaced.check_replaced`).
- `GradPlanning.clip_args`: `_clip.clipping`'s arguments for a call.
- `GradPlanning.set_divisor`: what the next backward's gradients are still divided by.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise._torch.module_state import own_buffers
from shardwise._torch.tensor_hooks import reattach_hooks, swapped_on_conversion
from shardwise.optim import FusionConfig, OptimizerParallel, OptimizerPlan
from shardwise.parallel._clip import PlanSplits, plan_splits
from shardwise.parallel._grad_buckets import GradBuckets
from shardwise.parallel._hsdp import bucket_plans, check_kinds, check_unfrozen, gradient_buckets
from shardwise.parallel._replaced import (
    check_replaced,
    fresh_storage,
    registrations,
    replaced_names,
)
from shardwise.parallel._runtime import cut_optimizer_state, shard_parameters
from shardwise.planner import ParallelPlan

_KIND = operator.attrgetter("dtype", "device")


class GradPlanning:
    """The gradient buckets of a run (see the module docstring); the run sets the
    attributes."""

    network: nn.Module
    fusion: FusionConfig | None
    engine: OptimizerParallel | None
    grads: GradBuckets | None
    grad_plan: OptimizerPlan | None
    grads_equal: dict[str, tuple[int, ...]]
    divisor: int  # what the next backward's gradients are still divided by (`set_divisor`)
    trainable: tuple[bool, ...]
    kinds: tuple[tuple[torch.dtype, torch.device], ...] = ()  # (the parameters' when planned)
    planned_trainable: tuple[bool, ...] | None = None  # (hsdp: those its buckets hold)
    watched: list[nn.Parameter]
    hooks: list[Any]
    templates: list[tuple[Any, Any]]
    parallel_plan: ParallelPlan | None
    plans: list[tuple[ParallelPlan, list[tuple[Any, Any]]]]
    optimizers: list[torch.optim.Optimizer]
    modules: list[nn.Module]
    rnns: list[nn.RNNBase]
    blocks: bool
    registered = -1  # (`registrations()` when the parameters were last listed)
    watched_names: list[str]
    _cut_later: Callable[[dict[str, Any]], None]
    _replan: Callable[..., None]

    @property
    def stored_plan(self) -> ParallelPlan:
        """The first plan: the one the parameters are stored by (planned already)."""
        return self.plans[0][0]

    def clip_args(self) -> tuple[PlanSplits, str, Callable[[bool], bool] | None]:
        """`clipping`'s arguments: the gradients' splits and, with hsdp, the reduction of
        gradients held unreduced until the optimizer step (level 1)."""
        engine = self.engine
        splits = plan_splits(self.network, self.stored_plan, engine.plan if engine else None)
        return splits, "", None if engine is None else engine.reduce_held

    def set_divisor(self, divisor: int) -> None:
        """What the gradients of the backward about to run are still to be divided by (the
        buckets', the optimizer-parallel engine's and the input hooks' divisor): N for a
        backward after the call (the caller's code seeds every rank's copy), the train step's
        from `_seeds` (1, or N where it left a seed unscaled); they read it when the
        gradients come."""
        self.divisor = divisor

    def _buckets(
        self, plan: ParallelPlan, buckets: OptimizerPlan | None = None, again: bool = False
    ) -> None:
        """The gradient buckets (`buckets`, else made from the first plan's parameters with
        `plan`'s equal gradients, `ParallelPlan.equal_grads`); made again when a plan variant's
        equal gradients differ, parameters were frozen or unfrozen since, or `again` (their
        dtypes or devices changed: `_moved`)."""
        now = self._trainable()
        if self.grads is not None:
            same = dict(plan.equal_grads) == self.grads_equal and now == self.trainable
            if same and not again:
                return
            self.grads.drop_unfinished()
            for h in self.grads.handles:
                h.remove()
                self.hooks.remove(h)
        if buckets is None:
            stored = self.stored_plan.param_layouts()
            buckets = gradient_buckets(self.network, stored, self.fusion, plan.equal_grads)
        self.grad_plan = buckets
        self.grads = GradBuckets(self.network, self.grad_plan, lambda: self.divisor)
        self.hooks += self.grads.handles
        self.trainable = now
        self.grads_equal = dict(plan.equal_grads)

    def _listed(self) -> None:
        """The network's parameters and their names, listed once (a walk of the modules on
        every call costs far more; listed again when parameters are replaced: `_replaced`)."""
        if not self.watched:
            named = list(self.network.named_parameters())
            self.watched, self.watched_names = [p for _, p in named], [n for n, _ in named]

    def param_names(self) -> dict[int, str]:
        """Parameter id -> its name, from the listed parameters (`_listed`: no walk of the
        modules; the executor's `PlanExecutor.params`)."""
        self._listed()
        return {id(p): n for n, p in zip(self.watched_names, self.watched, strict=True)}

    def _trainable(self) -> tuple[bool, ...]:
        """Whether each of the network's parameters requires a gradient, in parameter order."""
        self._listed()
        return tuple(p.requires_grad for p in self.watched)

    def _kinds(self) -> tuple[tuple[torch.dtype, torch.device], ...]:
        """Each parameter's dtype and device, in parameter order."""
        self._listed()
        return tuple(map(_KIND, self.watched))

    def _moved(self) -> str | None:
        """Why the call is planned again when a parameter's dtype or device changed since the
        plan (None: none did); with hsdp a ValueError (`check_kinds`). The parameters a
        conversion swaps get their hooks handed to autograd again first (a ``net.float()`` that
        changed nothing swapped them too: `reattach_hooks`)."""
        now = self._kinds()
        for p in swapped_on_conversion(self.watched):
            reattach_hooks(p)
        if now == self.kinds:
            return None
        if self.engine is not None:
            check_kinds(self.network, self.kinds)
        return "parameters of other dtypes or devices"

    def _replaced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Plan the call again when parameters were replaced since the plan (see the module
        docstring); nothing to do, in one integer comparison, when no module or parameter was
        registered anywhere since the last call."""
        count = registrations()
        if count == self.registered or self.parallel_plan is None:
            return
        self._listed()
        names, now = replaced_names(self.network, self.watched, self.watched_names)
        gone = set(self.stored_plan.params) - {n for n, _ in now}
        if names or gone:
            if self.engine is not None:  # (refused again at the next call: nothing changed)
                check_replaced(names or sorted(gone))
            self._adopt(args, kwargs, names, sorted(gone), now)
        self.registered = count

    def _adopt(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        names: list[str],
        gone: list[str],
        now: list[tuple[str, nn.Parameter]],
    ) -> None:
        """The call planned again for the replaced parameters `names` (and the `gone` ones),
        a new value of a split parameter's global shape cut to this rank's block."""
        before = self.watched, self.watched_names
        self.watched, self.watched_names = [p for _, p in now], [n for n, _ in now]
        try:
            stored = fresh_storage(self.stored_plan, self.network, [*names, *gone])
            self._replan(args, kwargs, f"replaced parameters {names or gone}", stored)
        except BaseException:
            self.watched, self.watched_names = before  # (tried again at the next call)
            raise
        assert self.parallel_plan is not None
        values = dict(now)
        split = {  # (a new value of the global shape cut to this rank's block)
            n: (layout, shape)
            for n, (layout, shape) in self.parallel_plan.param_layouts().items()
            if n in names and layout.used_axes() and tuple(values[n].shape) == tuple(shape)
        }
        shard_parameters(self.network, split)
        cut_optimizer_state(self.network, self.optimizers, split)
        self._cut_later(split)  # (a new optimizer's state: `StepHooks`)
        self.blocks = self.blocks or bool(split)
        self.modules = [m for m in self.network.modules() if own_buffers(m)]
        self.rnns = [m for m in self.network.modules() if isinstance(m, nn.RNNBase)]
        self._moved_planned()

    def _moved_planned(self) -> None:
        """After the call was planned again for parameters of other dtypes or devices: that
        plan the only one kept (the stored layouts are the same), the buckets made anew."""
        assert self.parallel_plan is not None
        self.plans = [(self.parallel_plan, self.templates)]
        self.kinds = self._kinds()  # (not before: a capture that raised is tried again)
        if self.grads is not None:
            self._buckets(self.parallel_plan, again=True)
        for p in self.watched:  # (swapped contents leave the hooks behind: `reattach_hooks`)
            reattach_hooks(p)

    def _check_trainable(self) -> None:
        """Plan the buckets again when parameters were frozen or unfrozen (`_trainable_changed`)."""
        if self._trainable() != self.trainable:
            self._trainable_changed()

    def _trainable_changed(self) -> None:
        """Parameters were frozen or unfrozen since the gradient buckets were planned: the
        buckets planned again, in the plan too, with its `ParallelPlan.frozen` (with hsdp an
        unfrozen one is refused and the buckets stay)."""
        plan = self.parallel_plan
        assert plan is not None
        frozen = {n for n, p in self.network.named_parameters() if not p.requires_grad}
        new = dataclasses.replace(plan, frozen=tuple(n for n in plan.params if n in frozen))
        if self.engine is not None:  # (checked against the first call's: their buckets exist)
            if self.planned_trainable is None:
                self.planned_trainable = self.trainable  # (not changed since the first call)
            check_unfrozen(self.network, self.planned_trainable)
            self.trainable = self._trainable()
        else:
            self._buckets(plan)
            assert self.grad_plan is not None
            new = dataclasses.replace(new, buckets=bucket_plans(self.grad_plan, plan.matrix))
        self.plans = [(new if p is plan else p, t) for p, t in self.plans]
        self.parallel_plan = new
