"""The seeds of a train step's backward from a root split over the ranks (`Seeds`).

shardwise differentiates the mean of every rank's copy of the step: a root whole on every rank
(the loss, made whole by its AllReduce) has one copy per rank, so its seed is divided by the
world size N, and every gradient inside backward (an activation's, a parameter's share before
its bucket sums the replicas) is one device's, as large as on one device: a float16 one, or a
``GradScaler``'s scaled one, overflows only where one device's would. A root split over the
ranks (``out.backward(torch.ones_like(out))`` on this rank's rows: each rank seeds only its own
block) has `Placed.spread` times fewer copies, so its seed is multiplied by spread / N. Which
tensor is split how comes from the plan:

1. the values the capture's backward started from (`ParallelPlan.roots`): their nodes take the
   executor's full path, which notes each output as its op makes it (`Seeds.note_roots`, in
   every pass of the plan);
2. a value the plan holds other than it leaves the call (`_leaving`: a Megatron split, rows
   over the data-parallel axis only): that placement;
3. under ``full_batch`` any other value is whole (the convention values leave in), and a 0-d
   one always is: seed as given.

A backward under ``data_parallel`` from any other tensor with dims (another output of the
network than the captured one, a tensor made by your code after an earlier backward) is refused
with `UnsupportedParallelError`: how it is split is not known, and guessing wrong would give
1/N of one device's gradients without a word.

`Seeds.scaled_seeds` takes a ``backward`` / ``torch.autograd.backward`` /
``torch.autograd.grad`` call's arguments and returns them with the seeds scaled (a seed not
given: ones times the factor, which `_differentiate` still treats as the same on every rank; a
seed that is a constant, ``torch.tensor(1.0)``, held as every rank's: `communication.every_rank`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise.communication import every_rank, get_group_size
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._leaving import _tensors
from shardwise.planner._call_kinds import seeds_of, with_seeds

if TYPE_CHECKING:
    from shardwise.parallel._node_table import NodeTable
    from shardwise.planner import EdgePlan

T = torch.Tensor


class Seeds:
    """Scales the seeds of backward calls by their roots' spread / N (see the module
    docstring); the executor sets `table` and calls `_seeds_init`."""

    table: NodeTable

    if TYPE_CHECKING:

        def _held(self, t: Any) -> tuple[EdgePlan, str] | None: ...

    def _seeds_init(self) -> None:
        self.noted: dict[int, tuple[weakref.ref[T], int]] = {}  # id -> (root, its scale)
        # (what the gradients are still divided by in the buckets and the input hooks: set
        # by the caller, `_graph_run.GraphRun.set_divisor`, before each backward)
        self.set_divisor: Callable[[int], None] | None = None

    def note_roots(self, k: int, out: Any) -> None:
        """Node `k`, a root node (`NodeTable.roots`), made `out`: note its root outputs."""
        for i, t in enumerate(_tensors(out)):  # (numbered as `Leaving.note_placed` does)
            scale = self.table.roots[k].get(i)
            if scale is not None:
                self.noted = {j: e for j, e in self.noted.items() if e[0]() is not None}
                self.noted[id(t)] = (weakref.ref(t), scale)

    def scaled_seeds(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        """`func`'s arguments with each root's seed multiplied by its spread / N, and what the
        gradients are still to be divided by (1; N where a low-precision root cannot hold its
        factor exactly: then its seeds are multiplied by the spread alone, as `divisor` says).

        Args:
            strict: a root whose placement is not known raises; otherwise (a ``torch.autograd
                .grad`` that keeps the graph: a gradient for monitoring) the seeds are left as
                given, taken as this rank's rows of a root split over every rank (divisor 1).

        Raises:
            UnsupportedParallelError: with `strict`, a root with dims whose placement the plan
                does not know, under ``data_parallel``.
        """
        roots, grads = seeds_of(func, args, kwargs)
        world = get_group_size()
        try:
            spreads = [self._scale(r) if isinstance(r, T) else world for r in roots]
        except UnsupportedParallelError:
            if strict:
                raise
            return args, kwargs, 1
        exact = all(
            _exact(r.dtype, world // spread)
            for r, spread in zip(roots, spreads, strict=False)
            if isinstance(r, T)
        )
        divisor = 1 if exact else world
        out, changed = [], False
        for root, grad, spread in zip(roots, grads, spreads, strict=False):
            scale = spread * divisor / world
            given = every_rank(grad) if isinstance(grad, T) else grad  # (a constant: per rank)
            if scale != 1:
                given = (torch.ones_like(root) if given is None else given) * scale
            changed |= given is not grad
            out.append(given)
        if changed:
            return (*with_seeds(func, args, kwargs, out), divisor)
        return args, kwargs, divisor

    def _scale(self, root: T) -> int:
        """How many ranks one copy of `root` is spread over (see the module docstring)."""
        noted = self.noted.get(id(root))
        if noted is not None and noted[0]() is root:
            return noted[1]
        held = self._held(root)
        if held is not None:
            return held[0].src.spread()
        if root.dim() == 0 or self.table.dataset == "full_batch":
            return 1
        raise UnsupportedParallelError(
            f"AutoParallel: a backward of the train step starts from a tensor of local shape "
            f"{list(root.shape)} that its captured backward did not start from, so how it is "
            f"split over the ranks is not known; start every backward of the step from what the "
            f"first one starts from, or from a 0-d loss (out.sum(), a mean)"
        )


def _exact(dtype: torch.dtype, copies: int) -> bool:
    """Whether a seed divided by `copies` stays exact enough in `dtype`: a power of two does
    in any floating dtype, any divisor in float32 / float64 (rounded by one part in 2**24 at
    most, as a division of the gradient would be); float16 / bfloat16 take 1/3 with a bias of
    up to 2e-3 on every gradient."""
    return copies & (copies - 1) == 0 or not dtype.is_floating_point or dtype.itemsize >= 4
