"""The seven collective primitives (``sw.ops.AllReduce`` ...) as autograd-aware modules.

Each primitive is a `torch.nn.Module` that checks its arguments when built and when called, and
runs a `torch.autograd.Function` whose backward is the collective's adjoint:

=================  =========================================  =================================
primitive          forward                                    backward (gradient)
=================  =========================================  =================================
AllReduce(SUM)     reduce over the group                      AllReduce(SUM) of the gradient
AllReduce(MAX/MIN) reduce                                     AllReduce(SUM)(g) where x == out
AllReduce(PROD)    reduce                                     AllReduce(SUM)(g) * the others'
                                                              product (`_others_product`)
AllGather          concat on dim 0                            ReduceScatter(SUM)
ReduceScatter      reduce, rank i keeps chunk i of dim 0      AllGather (masked for MAX/MIN;
                                                              PROD: times the others' product)
Broadcast          root's tensors on every rank               Reduce(SUM) onto the root
AlltoAll           split / send / concat                      AlltoAll with the dims swapped
NeighborExchange   point-to-point sends                       the reverse sends
NeighborExchangeV2 2-D halo exchange (8 directions, NCHW)     slices + exchange: autograd
=================  =========================================  =================================

Each backward runs its collective through these Functions (Broadcast's Reduce through
`_ReduceFn`, whose gradient is the Broadcast), so a gradient taken with ``create_graph=True``
is differentiable again; PROD's gradient (`_AllReduceProdFn`, `_ReduceScatterProdFn`) is
``once_differentiable``: differentiating it again raises.

Rank ids (``root_rank``, ``send_rank_ids`` ...) are global ranks and must belong to `group`.

`sum_over_ranks`, `average_gradient`, `replicated_seed` and `GradRoute` (the parallel
runtime's reductions, `_reductions`) are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from shardwise.communication import _collectives as C
from shardwise.communication import _sim, recorder
from shardwise.communication._collectives import ReduceOp, as_reduce_op
from shardwise.communication._exchange import exchange
from shardwise.communication._init import Group, get_group_size, resolve_group
from shardwise.communication._reductions import GradRoute as GradRoute
from shardwise.communication._reductions import GroupArg as GroupArg
from shardwise.communication._reductions import average_gradient as average_gradient
from shardwise.communication._reductions import replicated_seed as replicated_seed
from shardwise.communication._reductions import sum_over_ranks as sum_over_ranks


def _per_rank(value: Any) -> list[Any]:
    """`value` as each rank sees it (one entry outside a simulated world)."""
    sim = _sim.current()
    return sim.values(value) if sim is not None else [value]


def _others_product(x: torch.Tensor, group: GroupArg) -> torch.Tensor:
    """Per element, the product of the other ranks' `x` (the derivative of the ranks' product
    by this rank's factor), also where some factors are 0 (``out / x`` is NaN there): from the
    number of zeros and the product of the nonzero factors over the group."""
    zero = x == 0
    zeros = C.all_reduce(zero.to(x.dtype), ReduceOp.SUM, group)
    nonzero = C.all_reduce(torch.where(zero, torch.ones_like(x), x), ReduceOp.PROD, group)
    mine = torch.where(zero, nonzero, nonzero / torch.where(zero, torch.ones_like(x), x))
    return torch.where(zeros - zero.to(x.dtype) > 0, torch.zeros_like(x), mine)


class _AllReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: ReduceOp, group: GroupArg) -> torch.Tensor:
        out = C.all_reduce(x, op, group)
        ctx.op, ctx.group = op, group
        if op is not ReduceOp.SUM:
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        with recorder.phase("backward"):
            summed: torch.Tensor = _AllReduceFn.apply(g, ReduceOp.SUM, ctx.group)
            if ctx.op is ReduceOp.SUM:
                return summed, None, None
            x, out = ctx.saved_tensors
            return summed * (x == out), None, None


class _AllReduceProdFn(_AllReduceFn):
    """AllReduce(PROD): its gradient, the others' product, is differentiated once only."""

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x, _ = ctx.saved_tensors
        with recorder.phase("backward"):
            summed = C.all_reduce(g, ReduceOp.SUM, ctx.group)
            return summed * _others_product(x, ctx.group), None, None


class _AllGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupArg) -> torch.Tensor:
        ctx.group = group
        return C.all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        with recorder.phase("backward"):
            return _ReduceScatterFn.apply(g, ReduceOp.SUM, ctx.group), None


class _ReduceScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: ReduceOp, group: GroupArg) -> torch.Tensor:
        out = C.reduce_scatter(x, op, group)
        ctx.op, ctx.group = op, group
        if op is not ReduceOp.SUM:
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with recorder.phase("backward"):
            gathered: torch.Tensor = _AllGatherFn.apply(g, ctx.group)
            if ctx.op is ReduceOp.SUM:
                return gathered, None, None
            x, out = ctx.saved_tensors
            return gathered * (x == C.all_gather(out, ctx.group)), None, None


class _ReduceScatterProdFn(_ReduceScatterFn):
    """ReduceScatter(PROD): its gradient, the others' product, is differentiated once only."""

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, _ = ctx.saved_tensors
        with recorder.phase("backward"):
            return C.all_gather(g, ctx.group) * _others_product(x, ctx.group), None, None


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, root: int, group: GroupArg) -> torch.Tensor:
        ctx.root, ctx.group = root, group
        return C.broadcast(x, root, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with recorder.phase("backward"):
            return _ReduceFn.apply(g, ctx.root, ctx.group), None, None


class _ReduceFn(torch.autograd.Function):
    """Sum onto the root (Broadcast's gradient); its own gradient is the Broadcast."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, root: int, group: GroupArg) -> torch.Tensor:
        ctx.root, ctx.group = root, group
        return C.reduce(x, root, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with recorder.phase("backward"):
            return _BroadcastFn.apply(g, ctx.root, ctx.group), None, None


class _AlltoAllFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, split_dim: int, concat_dim: int, group: GroupArg
    ) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, concat_dim), group
        return C.all_to_all(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        split_dim, concat_dim = ctx.dims
        with recorder.phase("backward"):
            return _AlltoAllFn.apply(g, concat_dim, split_dim, ctx.group), None, None, None


class _ExchangeFn(torch.autograd.Function):
    """Point-to-point exchange; `plan` = (kind, send_to, recv_from, recv_shapes, dtype, group)."""

    @staticmethod
    def forward(ctx: Any, plan: tuple[Any, ...], *sends: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kind, send_to, recv_from, recv_shapes, dtype, group = plan
        device = sends[0].device if sends else torch.device("cpu")
        ctx.plan = plan
        ctx.send_shapes = [tuple(s.shape) for s in sends]
        outs = exchange(kind, sends, send_to, recv_from, recv_shapes, dtype, device, group)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        kind, send_to, recv_from, _, dtype, group = ctx.plan
        reverse = (kind, recv_from, send_to, ctx.send_shapes, dtype, group)
        with recorder.phase("backward"):
            back: tuple[torch.Tensor, ...] = _ExchangeFn.apply(reverse, *grads)
        return (None, *back)


def _check_tensor(op: str, x: Any, takes: str = "a tensor", what: str = "input") -> None:
    """A TypeError naming `op` when `x` (its `what`) is not a tensor; `takes`: what it takes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{op}: {what} must be a torch.Tensor, got {type(x).__name__}; {op} takes {takes} "
            "(convert with torch.as_tensor)"
        )


def _tensors(op: str, x: Any) -> tuple[torch.Tensor, ...]:
    """`x`, a tensor or an iterable of tensors (a tuple, a list, ``net.parameters()``, an
    ``nn.ParameterList``), as a tuple (a TypeError naming `op` else)."""
    takes = "a tensor or a tuple of tensors"
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, str | bytes) or not isinstance(x, Iterable):
        _check_tensor(op, x, takes)
    xs = tuple(x)
    for i, t in enumerate(xs):
        _check_tensor(op, t, takes, f"input {i}")
    return xs


def _check_group_arg(name: str, group: GroupArg) -> None:
    if group is not None and not isinstance(group, str | Group):
        raise TypeError(f"{name}: group must be a group name or None, got {type(group).__name__}")


class AllReduce(nn.Module):
    """Reduce a tensor over `group`; every rank gets the result.

    Args:
        op: `ReduceOp.SUM` (default), `MAX`, `MIN` or `PROD` (or their names).
        group: group name from `create_group`, or None for the world group.

    Example:
        >>> loss = sw.ops.AllReduce()(loss) / sw.communication.get_group_size()
    """

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: GroupArg = None) -> None:
        super().__init__()
        _check_group_arg("AllReduce", group)
        self.op, self.group = as_reduce_op(op), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tensor("AllReduce", x)
        fn = _AllReduceProdFn if self.op is ReduceOp.PROD else _AllReduceFn
        out: torch.Tensor = fn.apply(x, self.op, self.group)
        return out

    def extra_repr(self) -> str:
        return f"op={self.op.name}, group={self.group!r}"


class AllGather(nn.Module):
    """Concatenate every rank's tensor along dim 0 (group-rank order).

    Example:
        >>> y = sw.ops.AllGather()(x)      # x: [2, 8] on each of 4 ranks -> y: [8, 8]
    """

    def __init__(self, group: GroupArg = None) -> None:
        super().__init__()
        _check_group_arg("AllGather", group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tensor("AllGather", x)
        out: torch.Tensor = _AllGatherFn.apply(x, self.group)
        return out


class ReduceScatter(nn.Module):
    """Reduce over `group` and keep this rank's chunk of dim 0 (dim 0 must divide by N).

    Example:
        >>> y = sw.ops.ReduceScatter()(x)  # x: [8, 8] on each of 4 ranks -> y: [2, 8]
    """

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: GroupArg = None) -> None:
        super().__init__()
        _check_group_arg("ReduceScatter", group)
        self.op, self.group = as_reduce_op(op), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tensor("ReduceScatter", x)
        fn = _ReduceScatterProdFn if self.op is ReduceOp.PROD else _ReduceScatterFn
        out: torch.Tensor = fn.apply(x, self.op, self.group)
        return out


class Broadcast(nn.Module):
    """Send the tensors of global rank `root_rank` to every rank of `group`.

    Takes a tensor or a tuple of tensors and returns a tuple, as MindSpore's Broadcast.

    Example:
        >>> (w,) = sw.ops.Broadcast(0)((w,))
    """

    def __init__(self, root_rank: int, group: GroupArg = None) -> None:
        super().__init__()
        _check_group_arg("Broadcast", group)
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
            raise ValueError(f"Broadcast: root_rank={root_rank!r} must be a global rank (int >= 0)")
        self.root_rank, self.group = root_rank, group

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        xs = _tensors("Broadcast", x)
        C.check_member("Broadcast", self.root_rank, resolve_group(self.group), "root_rank")
        return tuple(_BroadcastFn.apply(t, self.root_rank, self.group) for t in xs)


class AlltoAll(nn.Module):
    """Split on `split_dim` into `split_count` chunks, send chunk i to rank i of the group, and
    concatenate what arrives along `concat_dim`.

    Args:
        split_count: must equal the group size.
        split_dim: the dim to split (its size must divide by `split_count`).
        concat_dim: the dim to concatenate the received chunks on.
        group: group name, or None for the world group.

    Example:
        >>> y = sw.ops.AlltoAll(4, 0, 1)(x)   # x: [8, 3] -> y: [2, 12]
    """

    def __init__(
        self, split_count: int, split_dim: int, concat_dim: int, group: GroupArg = None
    ) -> None:
        super().__init__()
        _check_group_arg("AlltoAll", group)
        for name, v in (("split_count", split_count), ("split_dim", split_dim)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"AlltoAll: {name}={v!r} must be an int")
        if isinstance(concat_dim, bool) or not isinstance(concat_dim, int):
            raise ValueError(f"AlltoAll: concat_dim={concat_dim!r} must be an int")
        if split_count < 1:
            raise ValueError(f"AlltoAll: split_count={split_count} must be >= 1")
        self.split_count, self.split_dim, self.concat_dim = split_count, split_dim, concat_dim
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tensor("AlltoAll", x)
        n = get_group_size(self.group)
        if self.split_count != n:
            raise ValueError(
                f"AlltoAll: split_count={self.split_count} must equal the group size {n}"
            )
        out: torch.Tensor = _AlltoAllFn.apply(x, self.split_dim, self.concat_dim, self.group)
        return out
