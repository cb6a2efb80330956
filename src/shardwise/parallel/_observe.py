"""Who is told when a wrapped network has planned: the hooks ``shardwise plan`` listens on.

- `Planned`: what a plan was made for: the `ParallelPlan` (with its gradient or
  optimizer-parallel buckets), the captured graph, the network, the optimizers the wrapper
  knows, the optimizer-parallel (or gradient-bucket) plan of its parameters.
- `add_plan_hook`: call a function with every `Planned` (after planning, before any parameter
  is cut or any step runs); returns a handle whose ``remove()`` stops it.
- `notify`: called by `_graph_run.GraphRun.plan`.
- `add_unplanned_hook` / `notify_unplanned`: the same for a wrapped network that runs without
  a plan (``parallel_mode="data_parallel"``), told its mode before its first step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.optim import OptimizerPlan
from shardwise.planner import Graph, ParallelPlan


@dataclass(frozen=True)
class Planned:
    """A plan just made (see the module docstring)."""

    plan: ParallelPlan
    graph: Graph
    network: nn.Module
    optimizers: tuple[torch.optim.Optimizer, ...] = ()
    buckets: OptimizerPlan | None = None
    hsdp: Any = field(default=None)


_hooks: list[Callable[[Planned], None]] = []
_unplanned_hooks: list[Callable[[str], None]] = []


class _Handle:
    def __init__(self, fn: Callable[[Any], None], hooks: list[Any]) -> None:
        self.fn = fn
        self.hooks = hooks

    def remove(self) -> None:
        if self.fn in self.hooks:
            self.hooks.remove(self.fn)


def add_plan_hook(fn: Callable[[Planned], None]) -> _Handle:
    """Call `fn(planned)` each time a wrapped network plans (see the module docstring).

    Example:
        >>> handle = add_plan_hook(lambda p: print(p.plan.matrix))
        >>> handle.remove()
    """
    _hooks.append(fn)
    return _Handle(fn, _hooks)


def notify(event: Planned) -> None:
    """Tell every hook (in the order they were added)."""
    for fn in list(_hooks):
        fn(event)


def add_unplanned_hook(fn: Callable[[str], None]) -> _Handle:
    """Call `fn(parallel_mode)` each time a wrapped network is about to run without a plan.

    Example:
        >>> handle = add_unplanned_hook(lambda mode: print(mode))
        >>> handle.remove()
    """
    _unplanned_hooks.append(fn)
    return _Handle(fn, _unplanned_hooks)


def notify_unplanned(parallel_mode: str) -> None:
    """Tell every unplanned-run hook (in the order they were added)."""
    for fn in list(_unplanned_hooks):
        fn(parallel_mode)
