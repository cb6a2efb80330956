"""The optimizer step hooks of a `_graph_run.GraphRun`: its running executor is told when an
optimizer steps (`_stepping.SteppingMode`: the executor leaves the mode stack while an optimizer
steps without a closure).

- `StepHooks._step_hooks`: registers torch's global optimizer step pre / post hooks, holding the
  run only weakly (a dropped wrapper frees its network; the hooks go with it);
- `StepHooks._step_starts` / `_step_ends`: forward the step to the running executor, with
  whether the step has a closure (which re-runs the network, and is watched); before the first
  step of an optimizer over parameters replaced since the plan and cut to their blocks, its
  state made at construction cut like them (`_cut_new_state`).
"""

from __future__ import annotations

import weakref
from typing import Any

from shardwise.optim._global_hooks import register_post, register_pre, remove_later
from shardwise.parallel._runtime import cut_optimizer_state


class StepHooks:
    """The step hooks of a run (see the module docstring); the run sets `executor` and
    `hooks`."""

    executor: Any
    hooks: list[Any]
    network: Any
    pending_cut: dict[str, Any] = {}  # (parameters cut since: `_cut_later`)  # noqa: RUF012
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
