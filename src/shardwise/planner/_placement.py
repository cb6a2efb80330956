"""Where semi_auto planning starts: the global device matrix and every input's and
parameter's first placement, plus what the planner's modules share.

- `_matrix`: the one global device matrix: the common refinement of the primitives' own
  matrices, those of declared layouts and the extra shapes (op-form annotations,
  ``sw.reshard``), axes named ``g0``, ``g1``, ...; two that do not nest: a PlanError naming
  both and the fix; `_global_axes`: the global axes an op matrix's axes cover after that
  refinement.
- `_input_state`: how each input arrives (split on dim 0 over all devices for
  ``"data_parallel"``, whole then sliced at entry for ``"full_batch"``, or the given
  per-input layouts) and which inputs are cut at entry; a ``"full_batch"`` input whose dim 0
  does not divide by the devices stays whole, with a warning under semi_auto (`_whole_batch`).
- `_param_layouts`: each parameter's storage layout: declared, else its first primitive
  consumer's, else the one its op-form annotated op reads it in, else whole.
- `data_parallel`: dim 0 split over every axis (semi_auto's default for activations);
  `PlanError`: what planning raises; `_itemsize`: a dtype's bytes per element.
- `to_placed` / `placements_of`: a `Placed` from and to DTensor placements.
- `read_whole`: the inputs only primitives read, each whole (kept whole under ``"full_batch"``);
  `check_rank_order`: a strategy's Layout with a ``rank_list`` refused.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from shardwise.layout import (
    DeviceMatrix,
    TensorLayout,
    common_refinement,
    from_placements,
    refine,
    to_placements,
)
from shardwise.layout._refine import untiled_block
from shardwise.ops import OpPlan
from shardwise.planner._annotated import RESHARD
from shardwise.planner._graph import Graph, Node, Ref
from shardwise.planner._plan import Placed, replicated

if TYPE_CHECKING:
    from shardwise.planner._planner import Planner

Shape = tuple[int, ...]
Placements = tuple[Placement, ...]
DatasetStrategy = str | Mapping[str, TensorLayout]


def to_placed(matrix: DeviceMatrix, placements: Sequence[Placement], ndim: int) -> Placed:
    """DTensor placements (one per axis of `matrix`) as a `Placed` (memoized: a `Placed` is
    immutable, and planning asks the same few placements thousands of times)."""
    return _to_placed(matrix, tuple(placements), ndim)


@functools.lru_cache(maxsize=1 << 16)
def _to_placed(matrix: DeviceMatrix, placements: Placements, ndim: int) -> Placed:
    partial = tuple(a for a, p in enumerate(placements) if isinstance(p, Partial))
    reduce = "sum"
    if partial:
        ops = {placements[a].reduce_op for a in partial}  # type: ignore[attr-defined]
        reduce = "avg" if ops == {"avg"} else "sum"
    plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    return Placed(from_placements(matrix, plain, ndim), partial, reduce)


def placements_of(placed: Placed) -> tuple[Placement, ...]:
    """A `Placed` as DTensor placements."""
    out = list(to_placements(placed.layout))
    for a in placed.partial:
        out[a] = Partial(placed.reduce)
    return tuple(out)


class PlanError(ValueError):
    """The network cannot be planned as asked; the message names the op, the tensor dim and
    the fix."""


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def data_parallel(matrix: DeviceMatrix, ndim: int) -> Placed:
    """Dim 0 split over every axis of `matrix`, outer first."""
    axes = tuple(a for a, s in enumerate(matrix.shape) if s > 1)
    return Placed(TensorLayout(matrix, (axes,) + ((),) * (ndim - 1)))


def _global_axes(op_matrix: DeviceMatrix, axes: Sequence[str], m: DeviceMatrix) -> tuple[str, ...]:
    """The global axes that an op-matrix axis list covers (after refinement)."""
    from shardwise.layout import axis_runs

    runs = axis_runs(op_matrix.shape, m.shape)
    return tuple(m.names[g] for a in axes for g in runs[op_matrix.axis(a)])


def _matrix(
    sources: Sequence[tuple[str, Shape]], device_num: int, layouts: Set[str] = frozenset()
) -> DeviceMatrix:
    """The common refinement of the `sources`' device matrices (each named as errors name it:
    ``"m1/MatMul with strategy ((3, 2), (2, 1))"``, its shape), or a PlanError naming two that
    do not nest and the fix (written for Layout calls for the sources named in `layouts`)."""
    try:
        shape = common_refinement([s for _, s in sources] or [(device_num,)])
    except ValueError as e:
        for (a, sa), (b, sb) in itertools.combinations(sources, 2):
            untiled = untiled_block([sa, sb])
            if untiled is not None and math.prod(sa) == math.prod(sb):
                kinds = {a in layouts, b in layouts}
                raise PlanError(_untiled_message(a, sa, b, sb, untiled, kinds)) from None
        raise PlanError(str(e)) from None
    return DeviceMatrix(shape, tuple(f"g{i}" for i in range(len(shape))))


def _untiled_message(
    a: str, sa: Shape, b: str, sb: Shape, untiled: tuple[int, int], layouts: Set[bool]
) -> str:
    """`layouts`: whether each of the two was given as Layout calls (True) or split counts."""
    n = math.prod(sa)
    forms = [f"({n}, 1)"] * (False in layouts) + [f"a Layout of device matrix ({n},)"] * (
        True in layouts
    )
    one_axis = forms[0] if forms == [f"({n}, 1)"] else f"({' or '.join(forms)})"
    few, many = untiled  # (numbers of blocks)
    bare = [tuple(x for x in s if x > 1) or (1,) for s in (sa, sb)]
    return (
        f"{a} has device matrix {list(sa)} and {b} has {list(sb)}: they do not nest. All ops "
        f"share one device matrix, on which each op's axes cut the {n} ranks (in row-major "
        f"order) into blocks of consecutive ranks, and every such block must tile each larger "
        f"one; here a block of {n // many} consecutive ranks does not tile a block of "
        f"{n // few}. Make the device matrices nest: give both the same one (both {bare[0]} or "
        f"both {bare[1]}), or give one of them a single axis of all devices {one_axis}, which "
        f"nests with any"
    )


def _input_state(
    p: Planner, graph: Graph, dataset: DatasetStrategy, warn: bool = False
) -> tuple[dict[str, Placed], list[tuple[str, Placed]]]:
    """How each input arrives, and the inputs cut at entry (full_batch); with `warn`
    (semi_auto), a full_batch input whose dim 0 does not divide by the devices is kept whole
    with a warning (`_whole_batch`)."""
    arrive: dict[str, Placed] = {}
    entry = []
    for key, info in graph.inputs.items():
        ref = Ref("input", key)
        ndim = len(info.shape)
        if isinstance(dataset, Mapping):
            layout = dataset.get(key)
            placed = (
                replicated(p.matrix, ndim) if layout is None else Placed(refine(layout, p.matrix))
            )
            arrive[key] = p.state[ref] = placed
            continue
        if ndim == 0 or info.shape[0] % p.device_num:
            if dataset == "data_parallel" and ndim:
                raise PlanError(
                    f"input {key}: dim 0 of global shape {list(info.shape)} cannot be split over "
                    f"{p.device_num} devices (dataset strategy 'data_parallel': each rank passes "
                    f"its own rows); use a global batch divisible by {p.device_num}"
                )
            if warn and ndim:
                _whole_batch(key, info.shape, p.device_num)
            arrive[key] = p.state[ref] = replicated(p.matrix, ndim)
            continue
        dp = data_parallel(p.matrix, ndim)
        if dataset == "full_batch":
            arrive[key] = replicated(p.matrix, ndim)
            entry.append((key, dp))
        else:
            arrive[key] = dp
        p.state[ref] = dp
    return arrive, entry


def _whole_batch(key: str, shape: Sequence[int], device_num: int) -> None:
    """Warn that full_batch input `key` (global `shape`) stays whole: its dim 0 does not divide
    by `device_num`."""
    warnings.warn(
        f"input {key}: dim 0 of global shape {list(shape)} ({shape[0]} rows) cannot be split "
        f"over {device_num} devices (dataset strategy 'full_batch'), so semi_auto keeps it "
        f"whole: the ops that read it run on all {shape[0]} rows on every rank (right results, "
        f"no speed-up; an annotated layer may still split rows where they divide); use a "
        f"global batch divisible by {device_num} (drop_last=True). An "
        f"input whose dim 0 is not a batch is meant whole: give it the layout (1, ...) in a "
        f"per-input dataset_strategy",
        UserWarning,
        stacklevel=2,
    )


def _param_layouts(
    graph: Graph,
    prims: Mapping[int, OpPlan],
    given: Mapping[str, TensorLayout],
    matrix: DeviceMatrix,
    pinned: Mapping[str, TensorLayout],
) -> dict[str, TensorLayout]:
    """Each parameter's storage layout: declared, else its first primitive consumer's, else
    the layout its op-form annotated op reads it in (`pinned`), else whole."""
    out = {n: refine(t, matrix) for n, t in given.items()}
    for node in graph.nodes:
        if node.index not in prims:
            continue
        for ref, layout in zip(node.inputs, prims[node.index].inputs, strict=True):
            if ref.kind == "param":
                out.setdefault(str(ref.key), refine(layout, matrix))
    for name, layout in pinned.items():
        out.setdefault(name, layout)
    for name, info in graph.params.items():
        out.setdefault(name, TensorLayout(matrix, ((),) * len(info.shape)))
    return {n: out[n] for n in graph.params}


def read_whole(graph: Graph, prims: Mapping[int, OpPlan]) -> set[str]:
    """The inputs that only primitives and ``sw.reshard`` read (each taking the layout it
    names: Gather's indices whole, a MatMul's input cut to columns): under ``"full_batch"``
    they stay as they arrive, whole, and each such reader cuts its block out of it locally;
    cut to rows at entry they were moved again (an AlltoAll to columns, AllGathers to whole)."""
    uses: dict[str, list[bool]] = {}
    for node in graph.nodes:
        for ref in node.inputs:
            if ref.kind == "input":
                sets_layout = node.index in prims or node.op == RESHARD
                uses.setdefault(str(ref.key), []).append(sets_layout)
    return {key for key, wants in uses.items() if all(wants)}


def check_rank_order(node: Node, what: str, matrix: DeviceMatrix) -> None:
    """Raise PlanError when `matrix` (of `node`'s strategy) has a ``rank_list``: the plan's
    device matrix orders the devices as the input convention does (rank order)."""
    if matrix.rank_list != tuple(range(matrix.size)):
        raise PlanError(
            f"{node.name} ({node.op}): {what} orders the devices by rank_list="
            f"{list(matrix.rank_list)}; AutoParallel places devices in rank order (as each "
            "rank's rows of the batch are). Use a Layout without rank_list "
            "(shardwise.redistribution and checkpoints take one)"
        )
