"""The data-parallel runner's plan, kept current and read (`RunnerPlan`, mixed into
`_data_parallel.DataParallelRunner`).

- `RunnerPlan._build_plan`: each network parameter's entry (its optimizer, owner rank and
  fusion id: `_data_parallel_plan.plan_entries`) and the gradient all-reduce and broadcast
  buckets (`plan_buckets`), noting what they depend on (`RunnerPlan._trained`: which
  parameters require gradients, the parameters of each optimizer's groups).
- `RunnerPlan._check_plan`, at each call and each optimizer step: plans again when that
  changed (with ``parallel_optimizer=True``, whose owners hold optimizer state, a ValueError).
- The plan as users read it: `RunnerPlan.owners`, `RunnerPlan.owned`,
  `RunnerPlan.collectives_per_step` and the table ``str(runner)`` prints (`plan_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.optim._data_parallel_plan import (
    WHO,
    CommBucket,
    ParamEntry,
    plan_buckets,
    plan_entries,
    plan_table,
)
from shardwise.optim._settings import FusionConfig


class RunnerPlan:
    """The plan of `DataParallelRunner` (which sets the attributes below)."""

    network: nn.Module
    optimizers: list[torch.optim.Optimizer]
    train_step: Callable[..., Any] | None
    parallel_optimizer: bool
    threshold_kb: float
    world: int
    entries: list[ParamEntry]
    _params: list[nn.Parameter]
    _fusion: FusionConfig
    _grad_buckets: list[list[CommBucket]]
    _broadcast_buckets: list[list[CommBucket]]
    _planned_for: tuple[Any, ...]

    def _build_plan(self) -> None:
        """Entries (owner, fusion id, buckets) of every network parameter, in order."""
        self.entries = plan_entries(
            self.network, self.optimizers, self.parallel_optimizer, self.threshold_kb, self.world
        )
        self._grad_buckets, self._broadcast_buckets = plan_buckets(
            self.entries, len(self.optimizers), self._fusion
        )
        self._planned_for = self._trained()

    def _trained(self) -> tuple[Any, ...]:
        """What the plan depends on: which parameters require gradients, and the parameters
        of each optimizer's groups."""
        groups = tuple(id(p) for o in self.optimizers for g in o.param_groups for p in g["params"])
        return tuple(p.requires_grad for p in self._params), groups

    def _check_plan(self) -> None:
        """Plan again when parameters were frozen or unfrozen, or an optimizer got a parameter
        group, since the plan was made (their gradients were not averaged): at each call and
        at each optimizer step (a change inside the train step); with ``parallel_optimizer``
        (owners hold state) a ValueError instead."""
        if self._trained() == self._planned_for:
            return
        if self.parallel_optimizer:
            raise ValueError(
                f"{WHO}: parameters were frozen or unfrozen, or an optimizer got a parameter "
                f"group, after the first call; with optimizer parallel each parameter's owner "
                f"holds its state, so the owners cannot be planned again: set requires_grad "
                f"and the parameter groups before the first call (lr=0 until a layer trains)"
            )
        self._build_plan()

    @property
    def owners(self) -> dict[str, int]:
        """Parameter name -> owner rank, for the parameters optimizer parallel assigned."""
        return {e.name: e.owner for e in self.entries if e.owner is not None}

    def owned(self, rank: int) -> list[str]:
        """Names of the parameters rank `rank` updates: its owned ones and the shared ones.

        Args:
            rank: a rank of the job.

        Returns:
            Parameter names in parameter order (only parameters of some optimizer).

        Example:
            >>> runner.owned(0)
            ['0.weight', '0.bias', '1.bias']
        """
        return [
            e.name
            for e in self.entries
            if e.optimizer is not None and (e.owner is None or e.owner == rank)
        ]

    def collectives_per_step(self) -> dict[str, int]:
        """How many AllReduce and Broadcast calls one step issues (the same whichever
        parameters got a gradient: a bucket is sent whole by every rank); the train-step form
        adds one AllReduce for the loss, and so does the module form per floating 0-d output of
        the network's (its loss).

        Returns:
            ``{"AllReduce": ..., "Broadcast": ...}``.

        Example:
            >>> runner.collectives_per_step()
            {'AllReduce': 4, 'Broadcast': 2}
        """
        reduces = sum(len(b) for b in self._grad_buckets)
        loss = 1 if self.train_step is not None else 0
        return {
            "AllReduce": reduces + loss,
            "Broadcast": sum(len(b) for b in self._broadcast_buckets),
        }

    def __str__(self) -> str:
        head = (
            f"{WHO}: {self.world} ranks, "
            f"{'train step' if self.train_step is not None else 'module'} form, "
            f"parallel_optimizer={self.parallel_optimizer}, threshold_kb={self.threshold_kb:g}"
        )
        counts = self.collectives_per_step()
        tail = f"per step: {counts['AllReduce']} AllReduce, {counts['Broadcast']} Broadcast"
        return "\n".join([head, *plan_table(self.entries), tail])
