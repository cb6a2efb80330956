"""The gradients of a wrapped call's tensor inputs that require grad: one device's.

A train step's backward is seeded with 1/N (N copies of the loss, N the job's size: `_seeds`),
so the gradient a rank computes for a value it holds is its share of that value's gradient
(of N times it where `_seeds` leaves a seed unscaled: the divisor it reports); a wrapped network
is differentiated by the caller's code from every rank's copy, so its shares are of N times the
gradient. Parameters' shares are summed over their replicas in the buckets and divided by that
divisor (1 or N). A tensor the caller passes gets the same: its shares summed over the axes the
caller holds it replicated on (``full_batch``: all of them; the rows the plan cut from the whole
batch are zero elsewhere), divided likewise (`_Division`): under ``data_parallel`` each rank
holds its rows of one device's gradient (no collective when the rows are split over every axis),
under ``full_batch`` all of it.

- `input_gradients` (a train step): a hook on each such input for the call, acting only while
  the step's own backward runs; an input computed from what another wrapped call returned
  (`from_calls`) is multiplied by N / divisor (its gradient goes on into that call's backward,
  whose buckets divide by N): the gradient on its way to the caller's tensors mixed into it
  after that call is divided by N again, on those edges of the graph (`_on_edge`).
- `entry_gradients` (a wrapped network, whose backward runs after the call): each such input
  enters the network through an autograd node that divides whatever gradient reaches it
  through the call, whenever that backward runs.
- `mark_outputs`: each call marks the autograd nodes of what it returns, not those of its own
  arguments returned as they are (`from_calls` walks an input's graph back to them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise._torch import pytree
from shardwise._torch.autograd_engine import node_metadata
from shardwise.communication import recorder
from shardwise.communication._collectives import ReduceOp, all_reduce
from shardwise.parallel._runtime import group_for
from shardwise.planner import ParallelPlan
from shardwise.planner._capture import input_key

T = torch.Tensor
MARK = "shardwise.call_output"  # (an autograd node's metadata key: `mark_outputs`)
WALK_LIMIT = 100_000  # (autograd nodes `from_calls` visits before it gives up: not from a call)


def mark_outputs(out: Any, call: Any) -> None:
    """Mark the autograd nodes of the tensors a wrapped call returns (`from_calls`), except
    those of the call's arguments `call` (an input returned as it is: the caller's node)."""
    theirs = {id(t.grad_fn) for t in pytree.tree_leaves(call) if isinstance(t, T)}
    for leaf in pytree.tree_leaves(out):
        values = (
            [getattr(leaf, f.name) for f in dataclasses.fields(leaf)]
            if (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type))
            else [leaf]
        )
        for value in values:
            node = value.grad_fn if isinstance(value, T) else None
            if node is not None and id(node) not in theirs:
                node_metadata(node)[MARK] = True


def from_calls(t: T) -> tuple[bool, list[tuple[Any, int]]]:
    """Whether `t` was computed from a tensor a wrapped call returned (`mark_outputs`), and then
    the edges of its autograd graph where the gradient leaves for the caller's own values: each
    ``(node, i)`` whose node leads to a marked node and whose i-th next node does not (in
    ``encoder(x) + extra``, the add's edge to ``extra``). A walk that stops at marked nodes and
    gives up past `WALK_LIMIT` nodes (then: not from a call)."""
    reaches: dict[int, bool] = {}  # node id -> it leads to a marked node
    order: list[Any] = []  # (nodes after every node they lead to: post-order)
    stack: list[tuple[Any, bool]] = [(t.grad_fn, False)]
    while stack and len(reaches) < WALK_LIMIT:
        node, expanded = stack.pop()
        if node is None or (id(node) in reaches and not expanded):
            continue
        if expanded:
            order.append(node)
            continue
        marked = bool(node_metadata(node).get(MARK))
        reaches[id(node)] = marked
        stack.append((node, True))
        if not marked:
            stack += [(n, False) for n, _ in node.next_functions if n is not None]
    if stack:
        return False, []
    for node in order:  # (each after what it leads to)
        if not reaches[id(node)]:
            reaches[id(node)] = any(reaches.get(id(n), False) for n, _ in node.next_functions)
    if t.grad_fn is None or not reaches[id(t.grad_fn)]:
        return False, []
    edges = [
        (node, i)
        for node in order
        if reaches[id(node)] and not node_metadata(node).get(MARK)
        for i, (n, _) in enumerate(node.next_functions)
        if n is not None and not reaches[id(n)]
    ]
    return True, edges


def _shares(plan: ParallelPlan, path: Any, dataset: object) -> tuple[str | None, bool]:
    """The group over which an input's shares are summed (the axes the caller holds it
    replicated on) and whether there is one."""
    matrix = plan.matrix
    placed = plan.inputs.get(input_key(pytree.keystr(path)))
    used = () if dataset == "full_batch" or placed is None else placed.layout.used_axes()
    axes = [a for a, n in enumerate(matrix.shape) if n > 1 and a not in used]
    return (group_for(matrix, axes)[0] if axes else None), bool(axes)


def _divided(g: T, group: str | None, summed: bool, divisor: int | None = None) -> T:
    """One device's gradient from a rank's share: summed over `group`, divided by `divisor`
    (N when None)."""
    if summed:
        with recorder.phase("backward"), recorder.label("input gradient"):
            g = all_reduce(g.clone(), ReduceOp.SUM, group)
    d = comm.get_group_size() if divisor is None else divisor
    return g / d if d != 1 else g


def input_gradients(
    plan: ParallelPlan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dataset: object,
    active: Callable[[], bool],
    divisor: Callable[[], int],
) -> list[RemovableHandle]:
    """Hooks that make a train step's tensor inputs' gradients one device's (see the module
    docstring), acting only while `active()` (the step's own backward runs), with the running
    backward's `divisor()`; a tensor passed twice gets one hook. Remove them when the call
    ends.

    Example:
        >>> handles = input_gradients(plan, (x,), {}, "data_parallel", lambda: True, lambda: 1)
    """
    handles: list[RemovableHandle] = []
    found: list[tuple[T, tuple[str | None, bool], bool, list[tuple[Any, int]]]] = []
    seen: set[int] = set()
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, T) or not leaf.requires_grad or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        found.append((leaf, _shares(plan, path, dataset), *from_calls(leaf)))
    # an input not from a call gets a hook on itself, which divides all of its gradient: an
    # edge of another input's graph into it only undoes that graph's factor N / divisor
    hooked = {_node_of(t) for t, _, marked, _ in found if not marked}
    edges_done: set[tuple[int, int]] = set()
    world = comm.get_group_size()

    def n() -> int:  # (the other call's divisor: its caller's backward, N)
        return world

    for leaf, shares, marked, edges in found:
        if not marked:
            handles.append(leaf.register_hook(_hook(_summing(shares, divisor), active)))
            continue
        # (N times the share from here on, as the other call's buckets expect)
        handles.append(leaf.register_hook(_hook(_times(n, divisor), active)))
        divide, back = _hook(_summing(shares, n), active), _hook(_times(divisor, n), active)
        for node, i in edges:  # (only the gradient on its way to the caller's own values)
            target = node.next_functions[i][0]
            if (id(node), i) not in edges_done:
                edges_done.add((id(node), i))
                undo = back if _node_key(target) in hooked else divide
                handles.append(node.register_hook(_on_edge(i, undo)))
    return handles


def _summing(shares: tuple[str | None, bool], by: Callable[[], int]) -> Callable[[T], T]:
    """`_divided` over `shares` (group, summed), by `by()` when the gradient comes."""
    return lambda g: _divided(g, *shares, by())


def _times(a: Callable[[], int], b: Callable[[], int]) -> Callable[[T], T]:
    """The gradient times a() / b() (itself when they are equal)."""
    return lambda g: g if a() == b() else g * (a() / b())


def _hook(how: Callable[[T], T], active: Callable[[], bool]) -> Callable[[T], T]:
    """A gradient hook applying `how` while `active()` (other code's backward: its own)."""

    def share_summed(g: T) -> T:
        return how(g) if active() else g

    return share_summed


def _node_of(t: T) -> int:
    """The autograd node that receives `t`'s gradient (a leaf's accumulate-grad node stands
    for the leaf)."""
    return id(t) if t.grad_fn is None else id(t.grad_fn)


def _node_key(node: Any) -> int:
    """`_node_of` for a graph node: the leaf it accumulates into, or itself."""
    variable = getattr(node, "variable", None)
    return id(variable) if isinstance(variable, T) else id(node)


def _on_edge(i: int, divide: Callable[[T], T]) -> Callable[..., Any]:
    """An autograd node's post hook that divides the gradient it passes to its `i`-th next
    node."""

    def hook(grad_inputs: tuple[T | None, ...], grad_outputs: Any) -> tuple[T | None, ...]:
        g = grad_inputs[i]
        if g is None:
            return grad_inputs
        return (*grad_inputs[:i], divide(g), *grad_inputs[i + 1 :])

    return hook


class _Division(torch.autograd.Function):
    """Identity forward; backward: one device's gradient from a rank's share (`_divided`)."""

    @staticmethod
    def forward(ctx: Any, x: T, group: str | None, summed: bool) -> T:
        ctx.group, ctx.summed = group, summed
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: T) -> tuple[T, None, None]:
        return _divided(g, ctx.group, ctx.summed), None, None


def entry_gradients(
    plan: ParallelPlan, args: tuple[Any, ...], kwargs: dict[str, Any], dataset: object
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A wrapped network's arguments with each tensor that requires grad (and was not computed
    from another call's result: `from_calls`) passed through `_Division` (see the module
    docstring); a tensor passed twice is divided on each path it takes.

    Example:
        >>> args, kwargs = entry_gradients(plan, (x,), {}, "data_parallel")
    """
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in flat]
    changed = False
    for i, (path, leaf) in enumerate(flat):
        if isinstance(leaf, T) and leaf.requires_grad and not from_calls(leaf)[0]:
            leaves[i] = _Division.apply(leaf, *_shares(plan, path, dataset))
            changed = True
    if not changed:
        return args, kwargs
    out: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_unflatten(leaves, spec)
    return out
