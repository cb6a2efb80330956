"""Wrapping a train-step function: find its network and optimizers, split its inputs.

- `find_referenced`: the `nn.Module`s and `torch.optim.Optimizer`s a function refers to, from
  its closure cells and the globals its code names (``__code__.co_names``).
- `pick_network`: the one referenced module holding parameters (the one containing the others).
- `check_dataset_strategy`: a dataset strategy's types (a name, or one int tuple / Layout call
  per input, never mixed); `input_layout`: the layout of input i under per-input strategies
  (each entry on its own device matrix, the repeat factor appended on the right as for a
  primitive).
- `dataset_input`: a global-batch input as this rank's share under a dataset strategy
  (``"data_parallel"``: this rank's rows, dim 0 split over every rank in rank order;
  ``"full_batch"``: the whole batch; per-input entries: this rank's block of the layout).
- `arriving_input`: the same for a wrapped module, whose inputs arrive already cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.layout import TensorLayout, resolve_strategy
from shardwise.ops import normalize_strategy
from shardwise.parallel._tracker import Tracker
from shardwise.redistribution import local_block

DATASET_STRATEGIES = ("data_parallel", "full_batch")
DatasetStrategy = str | tuple[tuple[int, ...] | TensorLayout, ...]
"""A dataset strategy name, or one entry (split counts or a Layout call) per input."""

_WHO = "dataset_strategy"


def check_dataset_strategy(strategy: object) -> DatasetStrategy:
    """`strategy` checked: ``"data_parallel"``, ``"full_batch"`` or per-input entries.

    Raises:
        ValueError: an unknown name; mixed int tuples and Layouts; a malformed entry.
    """
    if isinstance(strategy, str):
        if strategy not in DATASET_STRATEGIES:
            raise ValueError(
                f"{_WHO}: {strategy!r}; valid: {' | '.join(map(repr, DATASET_STRATEGIES))} or "
                f"one tuple / Layout call per input, e.g. ((8, 1), (8,))"
            )
        return strategy
    out = normalize_strategy(strategy, _WHO, _WHO)
    assert out is not None
    return out


def input_layout(
    strategy: DatasetStrategy, index: int, ndim: int, count: int, world: int
) -> TensorLayout | None:
    """The layout of input `index` (of `count`, `ndim` dims) under per-input `strategy`;
    None for a named strategy.

    Raises:
        ValueError: not one entry per input, or an entry that does not fit the input / world.
    """
    if isinstance(strategy, str):
        return None
    who = f"{_WHO} input {index}"
    if len(strategy) != count:
        raise ValueError(
            f"{_WHO}: {len(strategy)} entries for {count} tensor inputs; give one per input"
        )
    entry = strategy[index]
    if isinstance(entry, TensorLayout):
        if entry.ndim != ndim:
            raise ValueError(f"{who}: layout {entry} has {entry.ndim} dims, the input {ndim}")
        return resolve_strategy((entry,), world, who=who).layouts[0]
    if len(entry) != ndim:
        raise ValueError(
            f"{who}: strategy {entry} has {len(entry)} values but the input has {ndim} dims"
        )
    return resolve_strategy((entry,), world, who=who).layouts[0]  # one axis per dim


def find_referenced(fn: Callable[..., Any]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Modules and optimizers named by `fn` (closure cells first, then globals), in order."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"AutoParallel: cannot inspect {fn!r}; pass network= and optimizer=")
    values: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    scope = getattr(fn, "__globals__", {})
    values += [scope[name] for name in code.co_names if name in scope]
    unique = list({id(v): v for v in values}.values())
    modules = [v for v in unique if isinstance(v, nn.Module)]
    optimizers = [v for v in unique if isinstance(v, torch.optim.Optimizer)]
    return modules, optimizers


def pick_network(modules: list[nn.Module]) -> nn.Module:
    """The referenced module with parameters that contains every other one with parameters."""
    with_params = [m for m in modules if any(True for _ in m.parameters())]
    for m in with_params:
        inside = {id(s) for s in m.modules()}
        if all(id(o) in inside for o in with_params):
            return m
    names = [type(m).__name__ for m in with_params]
    raise ValueError(
        f"AutoParallel: the train step references {len(with_params)} modules with parameters "
        f"({names}) and none contains the others; pass network="
    )


def dataset_input(
    x: Any, strategy: DatasetStrategy, tracker: Tracker, index: int = 0, count: int = 1
) -> Any:
    """This rank's share of a global-batch input `x`, tracked as ``"dp"``, ``"rep"`` or its
    layout (input `index` of `count` tensor inputs)."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = tuple(int(s) for s in x.shape)
    layout = input_layout(strategy, index, x.dim(), count, comm.get_group_size())
    if layout is not None:
        layout.check(shape, f"{_WHO} input {index}")
        local = local_block(x, layout, shape)
        tracker.put(local, layout, shape)
        return local
    if strategy == "full_batch" or x.dim() == 0:
        tracker.put(x, "rep", shape)
        return x
    world = comm.get_group_size()
    if shape[0] % world:
        raise ValueError(
            f"AutoParallel: data_parallel dataset strategy: batch dim {shape[0]} of an input of "
            f"shape {list(shape)} is not divisible by the {world} ranks"
        )
    rows = shape[0] // world
    rank = comm.get_rank()
    local = x[rank * rows : (rank + 1) * rows]
    tracker.put(local, "dp", shape)
    return local


def arriving_input(
    x: Any, strategy: DatasetStrategy, tracker: Tracker, index: int = 0, count: int = 1
) -> None:
    """Track an input of a wrapped module: each rank passes its rows (``"data_parallel"``),
    the whole batch (``"full_batch"``) or its block under input `index`'s layout."""
    if not isinstance(x, torch.Tensor):
        return
    local = tuple(int(s) for s in x.shape)
    world = comm.get_group_size()
    layout = input_layout(strategy, index, x.dim(), count, world)
    if layout is not None:
        tracker.put(x, layout, tuple(n * layout.split_count(d) for d, n in enumerate(local)))
    elif strategy == "full_batch" or x.dim() == 0:
        tracker.put(x, "rep", local)
    else:
        tracker.put(x, "dp", (local[0] * world, *local[1:]))
