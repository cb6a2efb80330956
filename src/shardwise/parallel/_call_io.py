"""The inputs and outputs of one call `GraphRun` serves, as the plan sees them.

- `tensor_inputs`: each tensor input with its graph name (`planner._capture.input_key`).
- `input_layouts` / `input_shapes`: under per-input dataset entries each input's layout; each
  input's global shape (rows of all ranks under ``data_parallel``, the block times its split
  counts under a per-input layout) — what the plan is looked up by.
- `global_inputs`: the call's arguments as meta tensors of those global shapes (for capture).
- `local_inputs`: the other way, meta tensors shaped as one rank's inputs of given global
  shapes (`AutoParallel.plan` given shapes).
- `cut_inputs`: ``full_batch`` inputs cut to this rank's rows by the plan's entry edges.
- `rank_outputs`: a wrapped network's outputs as this rank's rows (``full_batch``: whole).
- `input_gradients`: hooks that make a train step's tensor inputs' gradients one device's;
  `mark_outputs` marks what a call returns, so that an input computed from another call's
  result is left to that call's gradient convention (`from_a_call`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise._torch import pytree
from shardwise._torch.autograd_engine import node_metadata
from shardwise.communication import recorder
from shardwise.communication._collectives import ReduceOp, all_reduce
from shardwise.layout import TensorLayout
from shardwise.parallel._edges import move
from shardwise.parallel._leaving import convention
from shardwise.parallel._runtime import group_for
from shardwise.parallel._step import DatasetStrategy, input_layout
from shardwise.planner import ParallelPlan, Placed
from shardwise.planner._capture import input_key
from shardwise.redistribution import redistribute

T = torch.Tensor
Call = tuple[tuple[Any, ...], dict[str, Any]]


def _global_shape(
    x: T, world: int, dataset: object, layout: TensorLayout | None
) -> tuple[int, ...]:
    """`x`'s global shape: rows of all ranks under data_parallel; its block's dims times their
    split counts under a per-input `layout`."""
    shape = [int(n) for n in x.shape]
    if layout is not None:
        shape = [n * layout.split_count(d) for d, n in enumerate(shape)]
    elif dataset == "data_parallel" and shape:
        shape[0] *= world
    return tuple(shape)


def tensor_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, T]]:
    """Each tensor input of a call with its graph name (`input_key`), in call order."""
    if not kwargs and all(isinstance(a, T) for a in args):  # (positional tensors: no pytree)
        return [(f"args[{i}]", a) for i, a in enumerate(args)]
    return [
        (input_key(pytree.keystr(path)), leaf)
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]
        if isinstance(leaf, T)
    ]


def input_layouts(
    dataset: object, world: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, TensorLayout]:
    """Under per-input dataset entries: each tensor input's layout by its graph name (the
    entries follow the tensors in call order); else empty."""
    if isinstance(dataset, str):
        return {}
    found = tensor_inputs(args, kwargs)
    out = {}
    for i, (key, leaf) in enumerate(found):
        layout = input_layout(dataset, i, leaf.dim(), len(found), world)  # type: ignore[arg-type]
        if layout is not None:
            out[key] = layout
    return out


def input_shapes(
    dataset: object, world: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Each tensor input's global shape, by its graph name."""
    layouts = input_layouts(dataset, world, args, kwargs)
    return {
        key: _global_shape(leaf, world, dataset, layouts.get(key))
        for key, leaf in tensor_inputs(args, kwargs)
    }


def global_inputs(
    dataset: object, world: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Call:
    """The call's arguments with each tensor replaced by a meta tensor of its global shape."""
    layouts = input_layouts(dataset, world, args, kwargs)
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, x in leaves:
        if isinstance(x, T):
            layout = layouts.get(input_key(pytree.keystr(path)))
            shape = _global_shape(x, world, dataset, layout)
            grad = x.requires_grad  # (``torch.autograd.grad(loss, [x])`` in the step)
            x = torch.empty(shape, dtype=x.dtype, device="meta").requires_grad_(grad)
        out.append(x)
    g_args, g_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(g_args), dict(g_kwargs)


def cut_inputs(plan: ParallelPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """``full_batch``: each input the plan cuts at entry, as this rank's rows."""
    entry = {e.value.removeprefix("input:"): e for e in plan.edges if e.consumer == -2}
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = []
    for path, leaf in flat:
        edge = entry.get(input_key(pytree.keystr(path)))
        leaves.append(leaf if edge is None or not isinstance(leaf, T) else move(leaf, edge))
    out: Call = pytree.tree_unflatten(leaves, spec)
    return out


def rank_outputs(plan: ParallelPlan, out: Any, dataset: object) -> Any:
    """A wrapped network's outputs as this rank's rows (``full_batch``: whole)."""
    leaves, spec = pytree.tree_flatten(out)
    placed = iter(plan.outputs)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, T):
            continue
        src: Placed = next(placed)
        gshape = tuple(int(s) * src.layout.split_count(d) for d, s in enumerate(leaf.shape))
        want = convention(src.layout.matrix, gshape, dataset)
        if src.layout != want.layout:
            leaves[i] = redistribute(leaf, src.layout, want.layout, gshape)
    return pytree.tree_unflatten(leaves, spec)


def local_inputs(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype] | None,
    dataset: DatasetStrategy,
    world: int,
) -> tuple[torch.Tensor, ...]:
    """Meta tensors shaped as one rank's inputs of the given global `shapes` under `dataset`
    (its rows under ``"data_parallel"``, the whole under ``"full_batch"``, its block under
    per-input entries).

    Raises:
        ValueError: a dtype count that differs from the shape count, or a global shape that the
            dataset strategy does not divide.
    """
    if dtypes is not None and len(dtypes) != len(shapes):
        raise ValueError(
            f"AutoParallel.plan: {len(dtypes)} dtypes for {len(shapes)} shapes; give one per input"
        )
    out = []
    for i, shape in enumerate(shapes):
        glob = tuple(int(s) for s in shape)
        dtype = torch.float32 if dtypes is None else dtypes[i]
        layout = input_layout(dataset, i, len(glob), len(shapes), world)
        if layout is not None:
            split = [layout.split_count(d) for d in range(len(glob))]
        elif dataset == "data_parallel" and glob:
            split = [world] + [1] * (len(glob) - 1)
        else:
            split = [1] * len(glob)
        for d, (n, k) in enumerate(zip(glob, split, strict=True)):
            if n % k:
                raise ValueError(
                    f"AutoParallel.plan: input {i} dim {d} has {n} elements, which the dataset "
                    f"strategy splits {k} ways; give a global shape divisible by {k}"
                )
        local = tuple(n // k for n, k in zip(glob, split, strict=True))
        out.append(torch.empty(local, dtype=dtype, device="meta"))
    return tuple(out)


MARK = "shardwise.call_output"  # (an autograd node's metadata key: `mark_outputs`)


def mark_outputs(out: Any) -> None:
    """Mark the autograd nodes of the tensors a wrapped call returns (`from_a_call`)."""
    for leaf in pytree.tree_leaves(out):
        values = (
            [getattr(leaf, f.name) for f in dataclasses.fields(leaf)]
            if (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type))
            else [leaf]
        )
        for value in values:
            if isinstance(value, T) and value.grad_fn is not None:
                node_metadata(value.grad_fn)[MARK] = True


def from_a_call(t: T, limit: int = 100_000) -> bool:
    """Whether `t` was computed from a tensor a wrapped call returned (`mark_outputs`): a walk
    of its autograd graph up to the first marked node (a leaf input: False at once; a walk past
    `limit` nodes: False)."""
    todo: list[Any] = [t.grad_fn]
    seen: set[int] = set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node_metadata(node).get(MARK):
            return True
        todo += [n for n, _ in node.next_functions]
    return False


def input_gradients(
    plan: ParallelPlan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dataset: object,
    active: Callable[[], bool],
) -> list[RemovableHandle]:
    """Hooks on the call's tensor inputs that require grad, making their gradients one
    device's: shardwise differentiates the sum of every rank's copy of the step (N copies, N
    the job's size: `communication.sum_over_ranks`), so a rank's gradient of its input is its
    share of N times the gradient. The hook sums the shares over the axes the input is
    replicated on as the caller holds it (``full_batch``: all of them; the rows the plan cut
    from the whole batch are zero elsewhere) and divides by N: under ``data_parallel`` each
    rank then holds its rows of one device's gradient (no collective when the rows are split
    over every axis), under ``full_batch`` all of it. It acts only while `active()` (the step's
    own ``loss.backward()`` runs); a tensor passed twice gets one hook. An input computed from
    a tensor another wrapped call returned gets none: its gradient goes on into that call's
    backward, whose own buckets divide by N (`from_a_call`). Remove the hooks when the call
    ends.

    Example:
        >>> handles = input_gradients(plan, (x,), {}, "data_parallel", lambda: True)
    """
    matrix, world = plan.matrix, comm.get_group_size()
    handles, seen = [], set()
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, T) or not leaf.requires_grad or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if from_a_call(leaf):  # (its gradient flows on into that call's backward as shares)
            continue
        placed = plan.inputs.get(input_key(pytree.keystr(path)))
        used = () if dataset == "full_batch" or placed is None else placed.layout.used_axes()
        axes = [a for a, n in enumerate(matrix.shape) if n > 1 and a not in used]
        group = group_for(matrix, axes)[0] if axes else None

        def share_summed(g: T, group: str | None = group, summed: bool = bool(axes)) -> T:
            if not active():  # (a backward of other code: its own gradient)
                return g
            if summed:
                with recorder.phase("backward"), recorder.label("input gradient"):
                    g = all_reduce(g.clone(), ReduceOp.SUM, group)
            return g / world

        handles.append(leaf.register_hook(share_summed))
    return handles
