"""The inputs and outputs of one call `GraphRun` serves, as the plan sees them.

- `tensor_inputs`: each tensor input with its graph name (`planner._capture.input_key`).
- `input_layouts` / `input_shapes`: under per-input dataset entries each input's layout; each
  input's global shape (rows of all ranks under ``data_parallel``, the block times its split
  counts under a per-input layout) — what the plan is looked up by.
- `global_inputs`: the call's arguments as meta tensors of those global shapes (for capture).
- `dataset_shapes`: under per-input entries, how each input's global shape was worked out (for
  an error raised while the step was captured on them).
- `local_inputs`: the other way, meta tensors shaped as one rank's inputs of given global
  shapes (`AutoParallel.plan` given shapes).
- `cut_inputs`: ``full_batch`` inputs cut to this rank's rows by the plan's entry edges;
  `caller_inputs`: such an input returned as it is, put back to the caller's whole tensor.
- `rank_outputs`: a wrapped network's outputs as this rank's rows (``full_batch``: whole).

The gradients of a call's inputs that require grad are `_input_grads`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.layout import TensorLayout
from shardwise.parallel._edges import move
from shardwise.parallel._leaving import convention
from shardwise.parallel._step import DatasetStrategy, input_layout
from shardwise.planner import EdgePlan, ParallelPlan, Placed
from shardwise.planner._capture import input_key
from shardwise.redistribution import redistribute

T = torch.Tensor
Call = tuple[tuple[Any, ...], dict[str, Any]]


def _global_shape(
    x: T, world: int, dataset: object, layout: TensorLayout | None
) -> tuple[int, ...]:
    """`x`'s global shape: rows of all ranks under data_parallel; its block's dims times their
    split counts under a per-input `layout`.

    Raises:
        ValueError: (ranks that one process runs) `x` has another size on some rank.
    """
    try:
        shape = [int(n) for n in x.shape]
    except (AttributeError, TypeError, RuntimeError):  # (a per-rank size: ranks differ)
        raise ValueError(
            f"AutoParallel: an input of shape {list(x.shape)} has other sizes on some ranks; "
            f"every rank passes the same shapes (its rows of the global batch: as many rows "
            f"on each rank; batch(..., drop_remainder=True) or a DistributedSampler with "
            f"drop_last=True for the last batch)"
        ) from None
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


def dataset_shapes(
    dataset: object, world: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """``input 1 (args[1]): block [2, 8] x splits (2, 1) = global [4, 8]; ...``: each tensor
    input's global shape under per-input entries, as worked out from this rank's block."""
    layouts = input_layouts(dataset, world, args, kwargs)
    parts = []
    for i, (key, leaf) in enumerate(tensor_inputs(args, kwargs)):
        layout = layouts.get(key)
        block = [int(n) for n in leaf.shape]
        splits = tuple(1 if layout is None else layout.split_count(d) for d in range(len(block)))
        glob = list(_global_shape(leaf, world, dataset, layout))
        parts.append(f"input {i} ({key}): block {block} x splits {splits} = global {glob}")
    return "; ".join(parts)


Cut = tuple[T, T, EdgePlan]  # (this rank's rows, the caller's whole input, the entry edge)


def cut_inputs(
    plan: ParallelPlan, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Call, list[Cut]]:
    """``full_batch``: each input the plan cuts at entry, as this rank's rows; and each cut
    (for `Leaving.note_inputs` and `caller_inputs`)."""
    entry = {e.value.removeprefix("input:"): e for e in plan.edges if e.consumer == -2}
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves, cuts = [], []
    for path, leaf in flat:
        edge = entry.get(input_key(pytree.keystr(path)))
        if edge is not None and isinstance(leaf, T):
            rows = move(leaf, edge)
            cuts.append((rows, leaf, edge))
            leaf = rows
        leaves.append(leaf)
    out: Call = pytree.tree_unflatten(leaves, spec)
    return out, cuts


def caller_inputs(out: Any, cuts: Sequence[Cut]) -> Any:
    """A train step's `out` with each cut input returned as it is put back to the caller's
    whole tensor (the same object, as one device returns it)."""
    if not cuts:
        return out
    whole = {id(rows): given for rows, given, _ in cuts}
    return pytree.tree_map(lambda x: whole.get(id(x), x) if isinstance(x, T) else x, out)


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


def float_shapes_hint(shapes: Sequence[Sequence[int]]) -> str:
    """What `AutoParallel.plan` adds to a capture error of its `shapes` inputs, given without
    dtypes: they were float32, which an op taking integers (cross entropy's class targets, an
    embedding's token ids, gather's index) refuses; the fix names ``dtypes=``."""
    shown = ", ".join(str(tuple(int(n) for n in s)) for s in shapes)
    example = ", ".join(["torch.float32"] * (len(shapes) - 1) + ["torch.int64"])
    return (
        f"AutoParallel.plan: the inputs of shapes=[{shown}] were float32 (the default without "
        "dtypes=); an input holding integers (class targets, token ids, indices) needs its "
        "dtype: give one dtype per shape, e.g. plan(shapes=[...], "
        f"dtypes=[{example}]) for integer targets last"
    )
