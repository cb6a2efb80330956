"""The plan executor's half for shardwise primitives (`PrimitiveHooks`, mixed into
`_executor.PlanExecutor`).

`GraphRun` registers a forward pre-hook and a forward hook on every primitive module:
`PrimitiveHooks.enter_primitive` moves the node's inputs as the plan's edges say and prepares
its local compute (`_local.prepare`); `PrimitiveHooks.leave_primitive` applies the output
fix-up, the op's own collectives (`NodePlan.comms`, `_edges.run_collective`) and the edges of
returned values. Where the network runs ops the plan does not have (before its first
backward) they raise `_errors.Replan`: `GraphRun` plans that call again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch.checkpointing import checkpointing
from shardwise.ops import Primitive
from shardwise.parallel._edges import average_outputs, run_collective
from shardwise.parallel._errors import Replan
from shardwise.parallel._local import prepare
from shardwise.planner import EdgePlan, ParallelPlan

if TYPE_CHECKING:
    from shardwise.parallel._node_table import NodeTable

T = torch.Tensor
_PASSED = object()  # a primitive call that is not a node (nested, or in an optimizer step)


class PrimitiveHooks:
    """The primitive hooks of `PlanExecutor` (which sets the attributes below)."""

    plan: ParallelPlan
    table: NodeTable
    paused: int
    cursor: int
    backward_seen: bool
    primitives: list[Any]

    if TYPE_CHECKING:

        @property
        def done(self) -> bool: ...

        def finish_started(self) -> None: ...

        def _restarts(self, op: str, args: Any) -> bool: ...

        def _advance(self, op: str, did: str, args: tuple[Any, ...], kwargs: Any) -> None: ...

        def _moved_inputs(self, k: int, tensors: list[Any]) -> list[Any]: ...

        def _returned(self, k: int, out: Any) -> Any: ...

        def _ended(self) -> None: ...

        def note_placed(self, k: int, edges: dict[int, EdgePlan], out: Any) -> None: ...

        def note_roots(self, k: int, out: Any) -> None: ...

        def _checkpointed(self, k: int) -> None: ...

        replay: Any

    def enter_primitive(
        self, module: Primitive, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A primitive's forward pre-hook: its node's inputs moved as the edges say (its
        parameters from their stored layout, through `param_value`), its local compute prepared
        (`_local.prepare`), a Reshape's target made local; the ops inside it are not nodes.
        During a checkpointed region's recomputation, the executor replaying it does this."""
        if self.replay is not None:
            return self.replay.enter_primitive(module, args, kwargs)  # type: ignore[no-any-return]
        self.finish_started()
        if self.paused:  # (inside another primitive, or an optimizer step)
            self.primitives.append(_PASSED)
            return None
        op = f"shardwise.ops.{module.name}"
        if self.done and not self._restarts(op, args):
            if not self.backward_seen:
                raise Replan(f"{op} after the plan's last op", self.cursor, op)
            self.primitives.append(_PASSED)
            return None
        if checkpointing():  # (a region's recomputation replays the plan from here on)
            self._checkpointed(self.cursor)
        self.paused += 1  # until `leave_primitive`: the moves and the primitive's own ops
        node = self.plan.nodes[self.cursor]
        tensors, call_args = module.split_call(*args)
        self._advance(op, "called", tuple(tensors), None)
        local = self._moved_inputs(node.index, list(tensors))
        layouts = [p.layout for p in node.inputs]
        local, fixup = prepare(
            module, node.local, local, layouts, node.in_shapes, call_args, node.comms
        )
        self.primitives.append((node.index, fixup))
        rest = args[len(tensors) :]
        if "shape" in call_args:  # Reshape: the local target shape
            target = node.local_shapes[0]
            if "shape" in kwargs:
                kwargs = {**kwargs, "shape": target}
            else:
                names = [k for k, _ in module.call_args]
                rest = tuple(
                    target if n == "shape" else a for n, a in zip(names, rest, strict=False)
                )
        return (*local, *rest), kwargs

    def leave_primitive(self, module: Primitive, args: tuple[Any, ...], output: Any) -> Any:
        """A primitive's forward hook: the output fix-up, the op's own collectives (from the
        plan's `NodePlan.comms`), the edges of returned values (during a recomputation: the
        replaying executor's)."""
        if self.replay is not None:
            return self.replay.leave_primitive(module, args, output)
        if not self.primitives:
            return None
        entry = self.primitives.pop()
        if entry is _PASSED:
            return None
        k, fixup = entry
        single = isinstance(output, T)
        outs = [output] if single else list(output)
        try:
            if fixup is not None:
                outs = fixup.apply(outs)
            matrix = self.plan.matrix
            for c in self.plan.nodes[k].comms:
                if not c.block:  # (else run inside the op: BatchNorm's statistics)
                    outs[c.output] = run_collective(outs[c.output], c, matrix)
            out = self._returned(k, outs[0] if single else tuple(outs))
            if k in self.table.averaging:
                average_outputs(out, self.plan.nodes[k], matrix)
            leaving = self.table.leaving[k]
            if leaving is not None:  # (`_leaving`: held other than it leaves the call)
                self.note_placed(k, leaving, out)
            if k in self.table.roots:  # (a backward starts from it: `_seeds`)
                self.note_roots(k, out)
        finally:
            self.paused -= 1
        self._ended()
        return out
