"""Passes of one plan within a wrapped call: where a later pass starts (`Passes`, mixed into
`_executor.PlanExecutor`).

A train step may run its network more than once: gradient accumulation, an optimizer's closure.
The plan is captured up to the first ``loss.backward()``; after a backward, a call that starts
the plan again (`Passes._restarts`) moves the cursor back to a *restart point*
(`restart_points`): a node k up to where the first pass entered the network
(`Passes.network_entered`) such that no node from k on reads a value made before k. The ops
before it run once (``total = torch.zeros(())``); those from it run again in every pass (a
per-micro-batch ``x - x.mean(0)`` before the network included). The first restart point whose
op and parameters the call has is taken. Refused with `UnsupportedParallelError`, never run
unplanned: a network entered again whose first op starts no pass (`Passes._refuse_pass`), and
a pass whose first op reads a tensor an op outside the plan made since the last backward
(`Passes.made_outside`: that op would have run on this rank's rows only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch import pytree
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._node_table import NodeTable
from shardwise.planner import NodePlan, ParallelPlan

T = torch.Tensor


def _held(made: dict[int, weakref.ref[T]], t: T) -> bool:
    ref = made.get(id(t))
    return ref is not None and ref() is t


def restart_points(nodes: Sequence[NodePlan]) -> tuple[int, ...]:
    """The nodes k at which a later pass may start: no node from k on reads a value made by a
    node before k.

    Example:
        >>> restart_points(plan.nodes)[:2]  # (total = torch.zeros(()), then the network)
        (0, 1)
    """
    crossing = [0] * (len(nodes) + 1)  # (+1 where a value's span opens, -1 after it closes)
    for j, node in enumerate(nodes):
        for value in node.values:
            if value.startswith("%"):
                i = int(value[1:].split(".")[0])
                crossing[i + 1] += 1
                crossing[j + 1] -= 1
    points, open_spans = [], 0
    for k in range(len(nodes)):
        open_spans += crossing[k]
        if open_spans == 0:
            points.append(k)
    return tuple(points)


class Passes:
    """Where a later pass starts (see the module docstring); `PlanExecutor` sets the
    attributes."""

    plan: ParallelPlan
    cursor: int
    finished: bool
    outside: bool
    start: int
    network_start: int | None
    reentered: bool
    table: NodeTable
    made_outside: dict[int, weakref.ref[T]]  # made by ops outside the plan since it started

    if TYPE_CHECKING:

        @property
        def params(self) -> dict[int, str]: ...

    def _restarts(self, op: str, args: Any) -> bool:
        """After the plan ran and a backward: whether this call starts it again (gradient
        accumulation, an optimizer's closure) at a restart point (see the module docstring),
        with the same parameters in the same places (other inputs may differ: a scaled batch,
        another chunk)."""
        if not self.finished or not self.plan.nodes:
            return False
        table = self.table
        if table.points is None:  # (once per plan)
            table.points = restart_points(self.plan.nodes)
        last = self.network_start or 0
        for start in table.points:
            if start > last:
                break
            if self._starts_with(start, op, args):
                self._check_inputs(op, start, args)
                self.cursor, self.finished, self.outside = start, False, False
                self.start, self.reentered = start, False
                self.made_outside = {}
                return True
        return False

    def _check_inputs(self, op: str, k: int, args: Any) -> None:
        """Refuse a pass whose first op reads a tensor made outside the plan since the last
        backward (on this rank's rows only, without the plan's collectives and masks)."""
        made = self.made_outside
        if any(isinstance(t, T) and _held(made, t) for t in pytree.tree_leaves(args)):
            node = self.plan.nodes[k]
            raise UnsupportedParallelError(
                f"AutoParallel: {op} starts the plan again at %{k} {node.name} after "
                f"loss.backward(), but reads a tensor made by an op the plan does not have "
                f"(after the backward, outside the plan, so on this rank's rows only); every "
                f"pass must run the ops of the first from where it starts"
            )

    def _starts_with(self, k: int, op: str, args: Any) -> bool:
        """Whether a call of `op` on `args` is node `k`'s (the same parameters in its places)."""
        node = self.plan.nodes[k]
        if op != node.op:
            return False
        tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, T)]
        if len(tensors) != len(node.values):
            return False
        for t, value in zip(tensors, node.values, strict=True):
            name = self.params.get(id(t))
            if (name is not None or value.startswith("param:")) and value != f"param:{name}":
                return False
        return True

    def _refuse_pass(self, op: str) -> None:
        """Raise: the network was entered again, but `op` starts no pass of the plan."""
        nodes = self.plan.nodes
        where = [f"%0 {nodes[0].name} ({nodes[0].op})"]
        if self.network_start:
            k = self.network_start
            where.append(f"%{k} {nodes[k].name} ({nodes[k].op}), where it entered the network")
        raise UnsupportedParallelError(
            f"AutoParallel: the network was called again after loss.backward() (gradient "
            f"accumulation, a closure), but its first op {op} is not the plan's "
            f"{' or '.join(where)}: every pass must run the ops of the first (plan another "
            f"step for another network, or call it in a separate wrapped call)"
        )

    def network_entered(self) -> None:
        """The network's forward begins: the node the first pass was at when it did is where a
        later pass may start again (`_restarts`)."""
        if self.finished:
            self.reentered = True
        elif self.network_start is None:
            self.network_start = self.cursor
        super().network_entered()  # type: ignore[misc]
