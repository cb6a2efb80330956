"""The reductions the parallel runtime runs on partial values (re-exported by `primitives`).

`sum_over_ranks(x, group, divisor)` is the AllReduce(SUM) (then / `divisor`) by which the
parallel runtime makes a partial value (a loss over this rank's rows) whole (optionally only
started, finished by the caller later: the plan executor's returned loss). Its backward is
the same AllReduce of the gradient, except inside `replicated_seed(out)`, the block that runs
``out.backward()`` without a gradient argument: the seed (ones) is then the same on every rank,
and the sum over the group of N equal values is N times the value, computed locally: one
synchronizing collective per training step fewer; so does, inside that block, a result marked
``seeded`` (the plan knows only ops alike on every rank read it, so its gradient comes from the
seed alike on every rank: ``(loss / 4).backward()``; the mark names the run of the plan, so
results of other runs keep their AllReduce). A plan that knows the result's gradient is the
same on some of the group's ranks says so with a `GradRoute` (the AllReduce over the other ranks
only, or none). With a weight (a mean loss's counted targets) and ``defer``, a seeded backward
does not wait for the summed weight (`_count_factor`). `average_gradient(x, group)` is the
other side (Megatron's ``f``): in backward it replaces the gradient of `x` by its mean over the
group, making it the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from shardwise._torch.autograd_engine import backward_node_class, current_graph_task_id
from shardwise.communication import _collectives as C
from shardwise.communication import _sim, recorder
from shardwise.communication._collectives import ReduceOp
from shardwise.communication._count_factor import note_factor
from shardwise.communication._init import Group, get_group_size

GroupArg = str | Group | None


class GradRoute(NamedTuple):
    """The adjoint of a `sum_over_ranks` whose result's gradient is the same on some of its
    group's ranks (each holds an equal share of the summed gradient): the AllReduce of the
    gradient over `group` only (None: the world; no collective when `reduce` is False), then
    times `times` (the number of ranks the gradient is equal on)."""

    group: GroupArg
    reduce: bool
    times: int


class _SumOverRanksFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: GroupArg,
        divisor: int,
        route: GradRoute | None,
        started: list[Any] | None,
        weight: torch.Tensor | None,
        seeded: object | None,
        defer: bool,
    ) -> torch.Tensor:
        ctx.group, ctx.divisor, ctx.replicated_seed, ctx.route = group, divisor, False, route
        ctx.seeded, ctx.defer = seeded, False
        if weight is not None:
            if defer:  # (the count's estimate: this rank's times the group size; see backward)
                ctx.defer, size = True, get_group_size(group)
                ctx.counted = weight.detach().float() * size  # (the factor's numerator)
                ctx.estimate = torch.where(weight > 0, ctx.counted, size)  # (a divisor: not 0)
            return _weighted(ctx, x, weight, group, started)
        if started is None:
            out = C.all_reduce(x, ReduceOp.SUM, group)
            return out / divisor if divisor != 1 else out
        out = x.detach().clone(memory_format=torch.contiguous_format)
        pending = C.all_reduce_async(out, ReduceOp.SUM, group)

        def finish() -> None:
            pending.wait()
            if divisor != 1:  # (in place, also on a tensor made under inference_mode)
                with torch.inference_mode(out.is_inference()), torch.no_grad():
                    out.div_(divisor)

        started.append(finish)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        seeded = ctx.replicated_seed or (ctx.seeded is not None and ctx.seeded is _SEEDED[0])
        if isinstance(ctx.divisor, torch.Tensor) and ctx.defer and seeded:
            # not waiting for the summed count: / this rank's estimate of it, and the gradient
            # sums over ranks multiply each share by count x size / sum (`_count_factor`)
            note_factor(current_graph_task_id(), ctx.pending, ctx.counted, ctx.divisor)
            g = (g / ctx.estimate).to(g.dtype)
        elif isinstance(ctx.divisor, torch.Tensor):  # (the summed weight: `_weighted`)
            if ctx.pending is not None:  # (a backward alongside the started AllReduce)
                ctx.pending.wait()
            g = (g / ctx.divisor).to(g.dtype)
        elif ctx.divisor != 1:
            g = g / ctx.divisor
        none = (None, None, None, None, None, None, None)
        if seeded:
            # the same g on every rank: their sum is g * group size
            return g * get_group_size(ctx.group), *none
        route: GradRoute | None = ctx.route
        with recorder.phase("backward"):
            if route is None:
                return C.all_reduce(g, ReduceOp.SUM, ctx.group), *none
            if route.reduce:
                g = C.all_reduce(g, ReduceOp.SUM, route.group)
            return (g * route.times if route.times != 1 else g), *none


def _weighted(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: GroupArg, started: list[Any] | None
) -> torch.Tensor:
    """`sum_over_ranks` with a weight: one AllReduce of the pair (x, weight) in float32 (in
    float64 for a float64 `x`), the result their quotient; the summed weight becomes the
    backward's divisor."""
    kind = torch.promote_types(x.dtype, torch.float32)
    pair = torch.stack([x.detach().to(kind), weight.detach().to(kind)])
    if started is None:
        pair = C.all_reduce(pair, ReduceOp.SUM, group)
        ctx.divisor, ctx.pending = pair[1], None
        return (pair[0] / pair[1]).to(x.dtype)
    out = torch.empty((), dtype=x.dtype, device=x.device)
    pending = C.all_reduce_async(pair, ReduceOp.SUM, group)  # (in place on `pair`)
    ctx.divisor, ctx.pending = pair[1], pending  # (summed once backward waits for it)

    def finish() -> None:
        pending.wait()
        with torch.inference_mode(out.is_inference()), torch.no_grad():
            out.copy_(pair[0] / pair[1])

    started.append(finish)
    return out


def sum_over_ranks(
    x: torch.Tensor,
    group: GroupArg = None,
    divisor: int = 1,
    route: GradRoute | None = None,
    started: list[Callable[[], None]] | None = None,
    weight: torch.Tensor | None = None,
    seeded: object | None = None,
    defer: bool = False,
) -> torch.Tensor:
    """The sum of `x` over the ranks of `group` (one AllReduce; none for a one-rank group),
    divided by `divisor` (or, with `weight`, by the sum of `weight` over the group: both summed
    in one AllReduce); the gradient is the AllReduce of the gradient / that divisor, or, when
    the result is the root of a seeded backward (`replicated_seed`), the gradient times the
    group size (no collective), or as `route` says.

    Args:
        x: this rank's partial value.
        group: group name, `Group` or None (the world).
        divisor: divide the sum by it (e.g. the world size, for a mean over all ranks' rows).
        route: the result's gradient is the same on some of the group's ranks: its adjoint.
        started: when given, the AllReduce is only started (in a real job: a simulated world
            runs it at once) and a function that finishes it is appended here: the result holds
            the sum only after that function ran, and must not be read before (its backward
            needs no value of it).
        weight: this rank's weight (a scalar without gradient, e.g. how many targets a mean
            loss counted here): the result is the weighted mean of the ranks' values when `x`
            is this rank's value times its weight (the mean of a loss over all ranks' counted
            targets, when they count differently).
        seeded: only ops that run alike on every rank read the result (within the run of a
            plan this object stands for): inside `replicated_seed` with the same object (a
            backward from a seed of ones on a root that run made) its gradient is the same on
            every rank, and the adjoint is local.
        defer: (with `weight`) a seeded backward does not wait for the summed weight: it
            divides by this rank's weight times the group size and notes the factor by which
            the backward's gradient sums must correct each rank's share (`_count_factor`).

    Returns:
        The reduced value, the same on every rank.

    Example:
        >>> loss = sum_over_ranks(local_sum, None, divisor=global_rows)  # doctest: +SKIP
    """
    if get_group_size(group) == 1:  # this rank's value is the sum: no collective
        if weight is not None:
            return x / weight
        return x / divisor if divisor != 1 else x
    if _sim.current() is not None:  # (one process runs every rank: nothing to overlap)
        started = None
    out: torch.Tensor = _SumOverRanksFn.apply(
        x, group, divisor, route, started, weight, seeded, defer
    )
    return out


def average_gradient(x: torch.Tensor, group: GroupArg) -> torch.Tensor:
    """`x` itself, whose gradient (the sum of what all its consumers gave it) is replaced in
    backward by its mean over the ranks of `group` (one AllReduce; a hook on `x`): the ranks'
    shares of the summed gradient made equal (Megatron's ``f``). Nothing for a leaf, a tensor
    without gradient or a one-rank group.

    Example:
        >>> h = average_gradient(layer_norm(x), "mp")  # doctest: +SKIP
    """
    size = get_group_size(group)
    if size == 1 or not x.requires_grad or x.grad_fn is None:
        return x

    def hook(g: torch.Tensor) -> torch.Tensor:
        with recorder.phase("backward"):
            return C.all_reduce(g, ReduceOp.SUM, group).div_(size)

    x.register_hook(hook)
    return x


_SEEDED: list[object | None] = [None]
"""The run whose ``seeded`` results a running `replicated_seed` block covers (read by their
backward; not per thread: autograd may run a backward on its device threads)."""


@contextmanager
def replicated_seed(root: torch.Tensor, seeded: object | None = None) -> Iterator[bool]:
    """While the block runs ``root.backward()`` without a gradient (a seed of ones, the same on
    every rank): if `root` is a `sum_over_ranks` result (or its cast to another dtype), its
    backward multiplies by the group size instead of all-reducing, and so does that of every
    result marked with the object `seeded` (the run of a plan that made `root`: results of
    other runs or plans all-reduce). Yields whether `root` is one; the marks end with the
    block, so a later backward through a retained graph (another seed) all-reduces again.

    Example:
        >>> with replicated_seed(loss):  # doctest: +SKIP
        ...     loss.backward()
    """
    node: Any = root.grad_fn
    if type(node).__name__ == "ToCopyBackward0":  # (a float16 loss summed in float32, cast)
        node = node.next_functions[0][0]
    is_sum = isinstance(node, backward_node_class(_SumOverRanksFn))
    before = _SEEDED[0]
    _SEEDED[0] = seeded
    if is_sum:
        node.replicated_seed = True
    try:
        yield is_sum
    finally:
        _SEEDED[0] = before
        if is_sum:
            node.replicated_seed = False
