"""Gradient clipping by the norm of the whole gradients, as one device clips.

Under `AutoParallel` each parameter holds this rank's block and that block's gradient, so
torch's ``clip_grad_norm_`` would take the norm of this rank's blocks: another norm on each
rank, and another clipping than one device's. While a wrapped call runs (`clipping`), torch's
clipping takes its total norm from `_TotalNorm` instead (`_torch.clip_grad`: every call of
``torch.nn.utils.clip_grad_norm_``, however it was imported):

1. `GradSplits` (a wrapper's view of its parameters) says, for each gradient, which device
   axes split it (its parameter's stored layout; none for a whole one);
2. the gradients split over the same axes are one group: the norm of this rank's blocks
   (torch's own total norm), combined over the ranks of those axes (an AllReduce of the p-th
   powers, or of the maxima for the inf-norm: one per group);
3. the total is the norm of the groups' norms, the same on every rank and equal to one
   device's; torch then scales every gradient by ``min(1, max_norm / (total + 1e-6))``.

Where the gradients are not this rank's blocks of the whole ones (optimizer parallel, the
data-parallel mode) the clipping is refused with a ValueError naming why and the fix. Outside
a call, `AutoParallel.clip_grad_norm_` clips the same way (`clip_grad_norm_`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise._torch.clip_grad import TORCH_TOTAL_NORM, total_norm_replaced
from shardwise.communication import AllReduce, ReduceOp
from shardwise.layout import DeviceMatrix
from shardwise.planner import ParallelPlan

if TYPE_CHECKING:
    from shardwise.parallel._graph_run import GraphRun

GradSplit = tuple[DeviceMatrix, tuple[int, ...]] | None
"""The matrix and the axes (each of size > 1) that split a gradient; None: whole."""

GradSplits = Callable[[Sequence[torch.Tensor]], list[GradSplit]]
"""Each gradient's `GradSplit` (a tensor that is no parameter's gradient: None)."""

HSDP = (
    "clip_grad_norm_ inside AutoParallel with hsdp (optimizer parallel): each rank's gradients "
    "are shards reduce-scattered in backward (levels 2, 3) or reduced only at the optimizer "
    "step (level 1), so no norm of the whole gradients is taken there; clip without hsdp()"
)
DATA_PARALLEL = (
    "clip_grad_norm_ inside a parallel_mode='data_parallel' train step: the gradients are this "
    "rank's own until the optimizer step all-reduces them, so each rank would clip by another "
    "norm; use parallel_mode='semi_auto' (the same data-parallel plan, gradients reduced in "
    "backward), where it clips by the norm of the whole gradients"
)


def plan_splits(network: nn.Module, plan: ParallelPlan) -> GradSplits:
    """The `GradSplits` of `network`'s parameters' gradients, stored as `plan` says."""

    def split(name: str | None) -> GradSplit:
        if name is None or name not in plan.params:
            return None
        layout = plan.params[name].layout
        m = layout.matrix
        axes = tuple(a for a in layout.used_axes() if m.shape[a] > 1)
        return (m, axes) if axes else None

    def splits(grads: Sequence[torch.Tensor]) -> list[GradSplit]:
        names = {id(p.grad): n for n, p in network.named_parameters() if p.grad is not None}
        return [split(names.get(id(g))) for g in grads]

    return splits


class _TotalNorm:
    """torch's total norm of gradients, of the whole gradients (the module docstring)."""

    def __init__(self, splits: GradSplits | None, refused: str) -> None:
        self.splits, self.refused = splits, refused

    def __call__(
        self,
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        if self.refused or self.splits is None:
            raise ValueError(self.refused)
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not grads:
            return TORCH_TOTAL_NORM(grads, norm_type, error_if_nonfinite, foreach)  # type: ignore[no-any-return]
        groups: dict[GradSplit, list[torch.Tensor]] = {}
        for g, split in zip(grads, self.splits(grads), strict=True):
            groups.setdefault(split, []).append(g)
        p_norm = float(norm_type)
        if p_norm == 0:
            raise ValueError(
                "clip_grad_norm_ with norm_type 0 (torch counts the gradients that are not all "
                "zero) is not supported inside AutoParallel; use norm_type 2, 1 or inf"
            )
        norms = []
        for split, members in groups.items():
            local = TORCH_TOTAL_NORM(members, p_norm, False, foreach)
            norms.append(local if split is None else _over_ranks(local, p_norm, *split))
        return TORCH_TOTAL_NORM(norms, p_norm, error_if_nonfinite, foreach)  # type: ignore[no-any-return]


def _over_ranks(
    local: torch.Tensor, p_norm: float, matrix: DeviceMatrix, axes: tuple[int, ...]
) -> torch.Tensor:
    """The norm of a group's blocks over the ranks of `axes` from this rank's (`local`)."""
    from shardwise.parallel._runtime import group_for  # (the runtime imports this module)

    group, _ = group_for(matrix, axes)
    with torch.no_grad():
        if p_norm == float("inf"):
            return AllReduce(ReduceOp.MAX, group)(local)  # type: ignore[no-any-return]
        summed = AllReduce(ReduceOp.SUM, group)(local.double() ** p_norm)
        return (summed ** (1.0 / p_norm)).to(local.dtype)  # type: ignore[no-any-return]


@contextmanager
def clipping(splits: GradSplits | None, refused: str = "") -> Iterator[None]:
    """While the block runs, torch's clipping takes the norm of the whole gradients (`splits`:
    the running wrapper's), or is refused with ValueError(`refused`)."""
    with total_norm_replaced(_TotalNorm(splits, refused)):
        yield


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    splits: GradSplits | None,
    refused: str = "",
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the norm of the whole gradients (`splits`), or
    the ValueError `refused` (for `AutoParallel.clip_grad_norm_`, outside a wrapped call).

    Example:
        >>> clip_grad_norm_(net.parameters(), 1.0, 2.0, False, plan_splits(net, plan))
    """
    with clipping(splits, refused):
        out: torch.Tensor = nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite
        )
    return out


class Clipping:
    """`AutoParallel.clip_grad_norm_` (`AutoParallel` sets the attributes below)."""

    parallel_mode: str
    network: nn.Module
    _graph: GraphRun | None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the network's gradients by the norm of the whole gradients, as one device's
        ``torch.nn.utils.clip_grad_norm_(network.parameters(), ...)`` does; for code outside
        a wrapped call (inside one, torch's own function clips this way).

        Args:
            max_norm / norm_type / error_if_nonfinite: as torch's.

        Returns:
            The total norm of the whole gradients, the same on every rank.

        Raises:
            ValueError: before the first call, with hsdp or in the data-parallel mode (the
                message says why and what to do), or a norm_type of 0.

        Example:
            >>> loss = parallel_net(x).sum()
            >>> loss.backward()
            >>> parallel_net.clip_grad_norm_(1.0)
        """
        params, graph = self.network.parameters(), self._graph
        if self.parallel_mode == "data_parallel":
            return clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite, None, DATA_PARALLEL
            )
        if graph is None or not graph.plans:
            raise ValueError("AutoParallel.clip_grad_norm_: call the wrapper first (no plan yet)")
        splits = plan_splits(self.network, graph.stored_plan)
        refused = HSDP if graph.engine is not None else ""
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, splits, refused)
