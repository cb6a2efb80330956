"""The maximum over ranks of partial maxima, for an op whose reduced dim is split (ReduceMax).

`max_over_ranks(x, group, route)` runs one AllReduce(MAX) in forward. Its backward follows the
runtime's gradient convention (each rank holds a *share* of the result's gradient; the shares add
up, see `primitives.sum_over_ranks`): the shares are summed with one AllReduce(SUM) over the
group (or as a `GradRoute` says, when the plan knows they are equal on some ranks), and the sum
goes to the ranks whose partial maximum is the result (``x == out``); the others get zero.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.communication import _collectives as C
from shardwise.communication import recorder
from shardwise.communication._collectives import ReduceOp
from shardwise.communication._init import get_group_size
from shardwise.communication.primitives import GradRoute, GroupArg


class _MaxOverRanksFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: GroupArg, route: GradRoute | None
    ) -> torch.Tensor:
        out = C.all_reduce(x, ReduceOp.MAX, group)
        ctx.group, ctx.route = group, route
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, out = ctx.saved_tensors
        route: GradRoute | None = ctx.route
        with recorder.phase("backward"):
            if route is None:
                g = C.all_reduce(g, ReduceOp.SUM, ctx.group)
            else:
                if route.reduce:
                    g = C.all_reduce(g, ReduceOp.SUM, route.group)
                g = g * route.times if route.times != 1 else g
        return g * (x == out).to(g.dtype), None, None


def max_over_ranks(
    x: torch.Tensor, group: GroupArg = None, route: GradRoute | None = None
) -> torch.Tensor:
    """The elementwise maximum of `x` over the ranks of `group` (one AllReduce(MAX); none for a
    one-rank group); in backward, the summed gradient reaches the ranks holding the maximum.

    Args:
        x: this rank's partial maximum (the op over its block).
        group: group name, `Group` or None (the world).
        route: the result's gradient is the same on some of the group's ranks: its adjoint.

    Returns:
        The maximum, the same on every rank.

    Example:
        >>> m = max_over_ranks(block.amax(dim=1), "mp")  # doctest: +SKIP
    """
    if get_group_size(group) == 1:
        return x
    out: torch.Tensor = _MaxOverRanksFn.apply(x, group, route)
    return out
