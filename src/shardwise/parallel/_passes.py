"""Passes of one plan within a wrapped call: where a later pass starts (`Passes`, mixed into
`_executor.PlanExecutor`).

A train step may run its network more than once: gradient accumulation, an optimizer's closure.
The plan is captured up to the first ``loss.backward()``; after a backward, a call that starts
the plan again (`Passes._restarts`) moves the cursor back: to the plan's first op, or, once the
network's forward began again (`Passes.network_entered`), to the node where the first pass
entered it (ops before it, such as ``total = torch.zeros(())``, run once). A network entered
again whose first op is neither is refused (`Passes._refuse_pass`): it never runs unplanned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch import pytree
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.planner import ParallelPlan

T = torch.Tensor


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

    if TYPE_CHECKING:

        @property
        def params(self) -> dict[int, str]: ...

    def _restarts(self, op: str, args: Any) -> bool:
        """After the plan ran and a backward: whether this call starts it again (gradient
        accumulation, an optimizer's closure): the plan's first op, or, once the network was
        entered again, the op where the first pass entered it (a step whose first ops, such as
        ``total = torch.zeros(())``, run once before its micro-batches), with the same
        parameters in the same places (other inputs may differ: a scaled batch, another chunk)."""
        if not self.finished or not self.plan.nodes:
            return False
        starts = [0]
        if self.reentered and self.network_start:
            starts.append(self.network_start)
        for start in starts:
            if self._starts_with(start, op, args):
                self.cursor, self.finished, self.outside = start, False, False
                self.start, self.reentered = start, False
                return True
        return False

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
