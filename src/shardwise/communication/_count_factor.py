"""Gradient factors of a weighted mean loss whose backward did not wait for its summed count.

A cross entropy mean over rows split across ranks divides by the targets all ranks counted (the
sum of the ranks' counts, all-reduced with the loss: `_reductions.sum_over_ranks` with a
weight). A seeded backward of such a loss (`EdgePlan.deferred`) does not wait for that sum: it
divides by an estimate, this rank's count times the group size (the sum itself when every rank
counted alike; a rank that counted nothing divides by the group size: its loss's gradient is 0
anyway), and records the factor count x group size / sum for its backward (`note_factor`,
keyed by autograd's graph task). Whoever sums the gradients over ranks multiplies each rank's
share by that factor first (`corrected`, `correct_`; the plan executor's gradient buckets),
which makes the sum the one the true count gives. The factors add up to the group size over
the ranks (0 for a rank that counted nothing), so a share that is the same on every rank (a
term of the root not through the loss) sums as before. The factor is exactly 1 when the ranks
counted alike: on a host tensor nothing is then multiplied (`forget_factor` drops it after
backward; a backward whose gradients reach no bucket leaves its factor, and the oldest beyond
16 are dropped: graph task ids only grow, so none applies to a later backward).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.communication import _sim
from shardwise.communication._collectives import Pending

_KEPT = 16  # (factors of backwards that ended without `forget_factor`: the oldest dropped)


class _Factor:
    """count x group size / sum, computed once the sum's AllReduce finished (1 where no rank
    counted anything)."""

    def __init__(self, pending: Pending[Any] | None, estimate: torch.Tensor, summed: torch.Tensor):
        self.pending, self.estimate, self.summed = pending, estimate, summed
        self.value: torch.Tensor | float | None = None
        self.known = False

    def get(self) -> torch.Tensor | float | None:
        if not self.known:
            if self.pending is not None:
                self.pending.wait()
            if _sim.current() is None and self.summed.device.type == "cpu":  # (free to read)
                summed, estimate = float(self.summed), float(self.estimate)
                x = estimate / summed if summed > 0 else 1.0  # (float32 values: exact ratio 1)
                self.value = None if x == 1.0 else x
            else:  # (a device tensor, read without a sync; or every rank's in one process)
                self.value = torch.where(self.summed > 0, self.estimate / self.summed, 1.0)
            self.known = True
        return self.value


_FACTORS: dict[int, _Factor] = {}


def note_factor(
    task: int, pending: Pending[Any] | None, estimate: torch.Tensor, summed: torch.Tensor
) -> None:
    """Record for backward `task` that its gradient shares are to be multiplied by `estimate`
    (this rank's count x group size) / the sum (`summed` holds it once `pending` finished)."""
    _FACTORS[task] = _Factor(pending, estimate, summed)
    while len(_FACTORS) > _KEPT:
        del _FACTORS[next(iter(_FACTORS))]


def corrected(g: torch.Tensor, task: int) -> torch.Tensor:
    """`g` (a gradient share of backward `task`) times its factor (a new tensor), or `g`.

    Example:
        >>> g = corrected(g, current_graph_task_id())  # doctest: +SKIP
    """
    factor = _FACTORS.get(task)
    f = None if factor is None else factor.get()
    return g if f is None else g * f


def correct_(t: torch.Tensor, task: int) -> None:
    """Multiply `t` (gradient shares of backward `task`, e.g. a bucket) by the factor, in place.

    Example:
        >>> correct_(bucket.flat, task)  # doctest: +SKIP
    """
    factor = _FACTORS.get(task)
    f = None if factor is None else factor.get()
    if f is not None:
        with torch.no_grad():
            t.mul_(f)


def forget_factor(task: int) -> None:
    """Drop backward `task`'s factor (its gradients are summed)."""
    _FACTORS.pop(task, None)
