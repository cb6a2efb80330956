"""The seeds of a train step's backward from a root split over the ranks (`Seeds`).

shardwise differentiates the sum of every rank's copy of the step, and the data-parallel
gradient sums are divided by the group size (`planner._backward`). A root whole on every rank
(the loss, made whole by its AllReduce) has one copy per rank, which that division undoes; a
root split over the ranks (``out.backward(torch.ones_like(out))`` on this rank's rows: each
rank seeds only its own block) has `Placed.spread` times fewer. So the plan's roots
(`ParallelPlan.roots`, what the capture's backward started from) have their seeds multiplied
by `ParallelPlan.seed_scales` when the step's backward (or last ``torch.autograd.grad``)
starts from them, and so does a later backward from the same tensors (``retain_graph``).

`Seeds.scaled_seeds` takes the call's arguments and returns them with the seeds scaled; a
root the plan does not know (made after an op outside the plan) keeps its seed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from shardwise.planner import ParallelPlan
from shardwise.planner._call_kinds import seeds_of, with_seeds

T = torch.Tensor


class Seeds:
    """Scales the seeds of backward calls from the plan's roots (see the module docstring);
    the executor sets `plan`, `outside`, `finished` and calls `_seeds_init`."""

    plan: ParallelPlan
    outside: bool
    finished: bool

    def _seeds_init(self) -> None:
        scales = self.plan.seed_scales()
        self.scales = scales if any(s != 1 for s in scales) else ()  # (none: nothing to do)
        self.scaled: list[tuple[weakref.ref[T], int]] = []  # the roots seen, with their scale

    def scaled_seeds(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """`func`'s arguments with the seeds of the plan's split roots multiplied (call before
        the executor marks the pass finished)."""
        scales = self.scales
        if not scales:
            return args, kwargs
        roots, grads = seeds_of(func, args, kwargs)
        if not self.finished and not self.outside:  # (this pass's own backward: its roots)
            pairs = zip(roots, scales, strict=True) if len(roots) == len(scales) else ()
            self.scaled = [(weakref.ref(r), s) for r, s in pairs if isinstance(r, T) and s != 1]
        if not self.scaled:
            return args, kwargs
        out, changed = [], False
        for root, grad in zip(roots, grads, strict=False):
            scale = next((s for ref, s in self.scaled if ref() is root), 1)
            if scale != 1:
                grad = (torch.ones_like(root) if grad is None else grad) * scale
                changed = True
            out.append(grad)
        return with_seeds(func, args, kwargs, out) if changed else (args, kwargs)
