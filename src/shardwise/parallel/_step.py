"""Wrapping a train-step function: find its network and optimizers, split its inputs.

- `find_referenced`: the `nn.Module`s and `torch.optim.Optimizer`s a function refers to, from
  its closure cells and the globals its code names (``__code__.co_names``).
- `pick_network`: the one referenced module holding parameters (the one containing the others).
- `dataset_input`: a global-batch input as this rank's share under a dataset strategy
  (``"data_parallel"``: this rank's rows, dim 0 split over every rank in rank order;
  ``"full_batch"``: the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.parallel._tracker import Tracker

DATASET_STRATEGIES = ("data_parallel", "full_batch")


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


def dataset_input(x: Any, strategy: str, tracker: Tracker) -> Any:
    """This rank's share of a global-batch input `x` (tracked as ``"dp"`` or ``"rep"``)."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = tuple(int(s) for s in x.shape)
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
