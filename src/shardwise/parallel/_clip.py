"""Gradient clipping by the norm of the whole gradients, as one device clips.

Under `AutoParallel` each parameter holds this rank's block and that block's gradient, so
torch's ``clip_grad_norm_`` would take the norm of this rank's blocks: another norm on each
rank, and another clipping than one device's. `clip_grad_norm_` here takes the norm of the
whole gradients:

1. `GradSplits` (a wrapper's view of its parameters) says, for each parameter, which device
   axes split its gradient (those of its stored layout; none for a whole one);
2. the gradients split over the same axes are one group: the norm of this rank's blocks
   (torch's ``get_total_norm``), combined over the ranks of those axes (an AllReduce of the
   p-th powers, or of the maxima for the inf-norm: one collective per group);
3. the total is the norm of the groups' norms, the same on every rank and equal to one
   device's; torch's ``clip_grads_with_norm_`` then scales every gradient by
   ``min(1, max_norm / (total + 1e-6))``, as torch's own ``clip_grad_norm_`` does.

`clipping(splits)` makes ``torch.nn.utils.clip_grad_norm_`` this function while a wrapped call
runs, so a train step that clips as one device does (nanoGPT's ``grad_clip``) clips the same
inside `AutoParallel` unchanged; outside a call, `AutoParallel.clip_grad_norm_` does it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.communication import AllReduce, ReduceOp
from shardwise.layout import DeviceMatrix
from shardwise.planner import ParallelPlan

GradSplit = tuple[DeviceMatrix, tuple[int, ...]] | None
"""The matrix and the axes (each of size > 1) that split a parameter's gradient; None: whole."""

GradSplits = Callable[[nn.Parameter], GradSplit]
"""A parameter's `GradSplit` (raises `ValueError` where no norm of whole gradients can be
taken, naming why and the fix)."""

TORCH_CLIP = nn.utils.clip_grad_norm_
_active: list[GradSplits] = []


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    splits: GradSplits | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on parameters stored as blocks: clip by the norm of
    the whole gradients (see the module docstring).

    Args:
        parameters / max_norm / norm_type / error_if_nonfinite / foreach: as torch's.
        splits: each parameter's `GradSplit` (default: the running wrapper's; outside a
            wrapped call, torch's own clipping).

    Returns:
        The total norm of the whole gradients (the same on every rank).

    Raises:
        ValueError: gradients that are not this rank's blocks of the whole ones (optimizer
            parallel, the data-parallel mode: the message names the fix); as torch, a
            non-finite norm with `error_if_nonfinite`.

    Example:
        >>> norm = clip_grad_norm_(net.parameters(), 1.0)  # inside a wrapped train step
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    splits = splits if splits is not None else (_active[-1] if _active else None)
    if splits is None:
        return TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    groups: dict[GradSplit, list[torch.Tensor]] = {}
    for p in params:
        split = splits(p)  # type: ignore[arg-type]  # (asked for every one: it may refuse)
        if p.grad is not None:
            groups.setdefault(split if split is not None and split[1] else None, []).append(p.grad)
    if not groups:
        return torch.tensor(0.0)
    p_norm = float(norm_type)
    norms = []
    for split, grads in groups.items():
        local = nn.utils.get_total_norm(grads, p_norm, False, foreach)
        norms.append(local if split is None else _over_ranks(local, p_norm, *split))
    total = nn.utils.get_total_norm(norms, p_norm, error_if_nonfinite, foreach)
    nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


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


def plan_splits(network: nn.Module, plan: ParallelPlan, sharded: bool) -> GradSplits:
    """The `GradSplits` of `network`'s parameters stored as `plan` says (a parameter of
    another network: whole); with optimizer parallel (`sharded`) none: a `ValueError`."""
    names: dict[int, str] = {}

    def split(p: nn.Parameter) -> GradSplit:
        if sharded:
            raise ValueError(
                "clip_grad_norm_ inside AutoParallel with hsdp (optimizer parallel): each "
                "rank's gradients are shards reduce-scattered in backward (levels 2, 3) or "
                "reduced only at the optimizer step (level 1), so no norm of the whole "
                "gradients is taken there; clip without hsdp()"
            )
        if not names:
            names.update({id(q): n for n, q in network.named_parameters()})
        name = names.get(id(p))
        if name is None or name not in plan.params:
            return None
        layout = plan.params[name].layout
        m = layout.matrix
        return m, tuple(a for a in layout.used_axes() if m.shape[a] > 1)

    return split


def unreduced(p: nn.Parameter) -> GradSplit:
    """The `GradSplits` of ``parallel_mode="data_parallel"``: a `ValueError` (its gradients
    are this rank's until the optimizer step reduces them)."""
    raise ValueError(
        "clip_grad_norm_ inside a parallel_mode='data_parallel' train step: the gradients are "
        "this rank's own until the optimizer step all-reduces them, so each rank would clip "
        "by another norm; use parallel_mode='semi_auto' (the same data-parallel plan, "
        "gradients reduced in backward), where it clips by the norm of the whole gradients"
    )


@contextmanager
def clipping(splits: GradSplits) -> Iterator[None]:
    """While the block runs, ``torch.nn.utils.clip_grad_norm_`` is `clip_grad_norm_`, which
    reads `splits` (the running wrapper's parameters) when given none."""
    _active.append(splits)
    nn.utils.clip_grad_norm_ = clip_grad_norm_
    try:
        yield
    finally:
        _active.pop()
        if not _active:
            nn.utils.clip_grad_norm_ = TORCH_CLIP
