"""The optimizer step hooks of a `_graph_run.GraphRun`: its running executor is told when an
optimizer steps (`_stepping.SteppingMode`: the executor leaves the mode stack while an optimizer
steps without a closure).

- `StepHooks._step_hooks`: registers torch's global optimizer step pre / post hooks, holding the
  run only weakly (a dropped wrapper frees its network; the hooks go with it);
- `StepHooks._step_starts` / `_step_ends`: forward the step to the running executor, with
  whether the step has a closure (which re-runs the network, and is watched); before the first
  step of an optimizer over parameters replaced since the plan and cut to their blocks, its
  state made at construction cut like them (`_cut_new_state`); without hsdp, an ``LBFGS`` or
  ``Adafactor`` step over a parameter stored as an operator-level block is refused
  (`refuse_coupled`, also at the plan: `_graph_plans`, with the optimizer whose step runs the
  first call, `stepping_in_stack`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.optim import check_blocks, coupled
from shardwise.optim._global_hooks import register_post, register_pre, remove_later
from shardwise.parallel._runtime import cut_optimizer_state

if TYPE_CHECKING:
    from shardwise.planner import ParallelPlan


def refuse_coupled(
    optimizers: Iterable[torch.optim.Optimizer], network: nn.Module, plan: ParallelPlan
) -> None:
    """Raise ValueError for an ``LBFGS`` / ``Adafactor`` among `optimizers` stepping over a
    parameter of `network` that `plan` stores split (a block on each rank: its norms and
    statistics would be the block's; `optim.check_blocks`)."""
    optimizers = [o for o in optimizers if coupled(o) is not None]
    if not optimizers:
        return
    split = {}
    for name, p in network.named_parameters():
        entry = plan.params.get(name)
        layout = None if entry is None else entry.layout
        if layout is not None and layout.is_split():
            split[id(p)] = name
    check_blocks(optimizers, split)


def stepping_in_stack() -> list[torch.optim.Optimizer]:
    """The optimizers whose ``step`` runs further up this call stack: the module form's first
    call made inside ``opt.step(closure)`` (LBFGS), whose step's pre hooks ran before any plan;
    a wrapper without hsdp does not wrap closures to note them (`_hsdp.watch_closures`)."""
    found: list[torch.optim.Optimizer] = []
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "step" else None
        if isinstance(owner, torch.optim.Optimizer) and all(owner is not o for o in found):
            found.append(owner)
        frame = frame.f_back
    return found


class StepHooks:
    """The step hooks of a run (see the module docstring); the run sets `executor` and
    `hooks`."""

    executor: Any
    hooks: list[Any]
    network: Any
    pending_cut: dict[str, Any] = {}  # (parameters cut since: `_cut_later`)  # noqa: RUF012
    plans: list[Any]
    hsdp: Any
    cut_checked: weakref.WeakSet[Any]  # (optimizers `_cut_new_state` looked at since)

    def _step_hooks(self) -> None:
        """Global optimizer step hooks (`_step_starts` / `_step_ends`) that hold this run only
        weakly and go away with it, so that a dropped wrapper frees its network."""
        ref = weakref.ref(self)

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            run = ref()
            if run is not None:
                run._step_starts(optimizer, args, kwargs)

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            run = ref()
            if run is not None:
                run._step_ends(optimizer, args, kwargs)

        handles = [register_pre(pre), register_post(post)]
        weakref.finalize(self, remove_later, handles)  # (not mid-step: `_global_hooks`)
        self.hooks += handles

    def _step_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.hsdp is None and self.plans and coupled(optimizer) is not None:
            refuse_coupled([optimizer], self.network, self.plans[0][0])  # (the stored plan)
        if self.pending_cut and optimizer not in self.cut_checked:
            self._cut_new_state(optimizer)
        if self.executor is not None:
            # (torch passes the optimizer itself as args[0])
            closure = (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None
            self.executor.step_starts(optimizer, closure)

    def _step_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.executor is not None:
            self.executor.step_ends(optimizer)

    def _cut_later(self, split: dict[str, Any]) -> None:
        """Parameters just cut to their blocks (`split`: name -> (layout, global shape)): the
        state an optimizer made for them at construction is cut before its next step
        (`_cut_new_state`), each optimizer looked at once."""
        self.pending_cut = {**self.pending_cut, **split}
        self.cut_checked = weakref.WeakSet()

    def _cut_new_state(self, optimizer: Any) -> None:
        """Before an optimizer's first step since `_cut_later`, the state it made at
        construction (``Adagrad``'s ``sum``) for parameters cut to their blocks since (at the
        plan, or replaced by a global value: `_grad_plan.GradPlanning._replaced`) cut like
        them; an optimizer holding none of them (a frozen split weight in no optimizer) is not
        walked again at every step."""
        self.cut_checked.add(optimizer)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = {
            n for n, p in self.network.named_parameters() if id(p) in held and n in self.pending_cut
        }
        if names:
            cut_optimizer_state(self.network, [optimizer], {n: self.pending_cut[n] for n in names})
            self.pending_cut = {n: v for n, v in self.pending_cut.items() if n not in names}
