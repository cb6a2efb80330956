"""Activation checkpointing under a plan: a region's recomputation replays the plan's nodes.

``torch.utils.checkpoint(fn, ...)`` runs the region's ops in the forward (the executor carries
them out as usual: they are plan nodes, the capture recorded them) and runs ``fn`` again in
backward to recompute the tensors it did not keep. That recomputation runs inside autograd,
where the executor is not on the mode stack: its ops would run on this rank's blocks without
the plan's moves, collectives, sizes and dropout masks. `Recompute` (a base of
`_executor.PlanExecutor`):

- `Recompute._checkpointed`: at the first node a region runs, finds the region (a
  non-reentrant one's ``_CheckpointFrame``: `_torch.checkpointing.checkpoint_frame`; a
  reentrant one's autograd context: `reentrant_context`), notes the node and the random
  generators' state (`communication.draw_state`) and has the region's recomputation run
  through `_replay` (`around_recomputation` / `around_rerun`). A reentrant region's backward
  runs a backward of its own, whose gradients get no loss count factor: the call's deferred
  count is switched off. Nested regions, and what the caller forbids (`reentrant_refused`:
  reentrant regions with optimizer parallel), raise `UnsupportedParallelError` (optimizer
  parallel level 3 fills the freed weights again when the replay asks for them);
- `Recompute._replay`: a fresh executor of the same plan positioned at that node carries out the
  recomputation's ops (the same moves and collectives, recorded in the backward phase with a
  ``recompute from ...`` label), its dropouts drawing from the noted state (the same global
  masks; torch's early stop of a recomputation simply ends it). The ops of the saved-tensor
  pack hook on top (torch's recomputation hook detaches each tensor saved; it reaches this
  mode where a custom ``autograd.Function`` saves tensors with ``ctx.save_for_backward``) are
  no network ops: they run unmatched (`_torch.checkpointing.packing_around`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from shardwise import communication as comm
from shardwise._torch.checkpointing import (
    around_recomputation,
    around_rerun,
    checkpoint_frame,
    nested_checkpoint,
    packing_around,
    preserves_rng,
    reentrant_context,
)
from shardwise.communication import recorder
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.planner import ParallelPlan

REENTRANT_HSDP = (
    "reentrant checkpointing (use_reentrant=True) runs a backward of its own inside backward, "
    "which optimizer parallel does not follow; use checkpoint(..., use_reentrant=False) "
    "(Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False}))"
)
"""`Recompute.reentrant_refused` with optimizer parallel."""

NESTED = (
    "it is a checkpointed region inside another (nested torch.utils.checkpoint), which "
    "AutoParallel does not support; checkpoint the regions one after the other"
)


class Recompute:
    """Checkpointed regions of one executor (see the module docstring)."""

    plan: ParallelPlan
    run: object
    defer_count: bool
    paused: int

    if TYPE_CHECKING:

        def fresh(self) -> Any: ...

    def _recompute_init(self) -> None:
        self.regions: weakref.WeakSet[Any] = weakref.WeakSet()  # checkpointed regions seen
        self.replaying = False  # a region's recomputation (`_replay`)
        self.replay: Any = None  # the executor carrying out a recomputation now (primitives)
        self.no_recompute = ""  # why regions cannot be replayed (set by the caller)
        self.reentrant_refused = ""  # why reentrant ones cannot (set by the caller)
        # (optimizer parallel level 3: fills the freed weights a replay reads, before it runs)
        self.fill_weights: Callable[[list[str]], None] | None = None

    def _checkpointed(self, k: int) -> None:
        """Node `k` runs inside activation checkpointing: at a region's first node, its
        recomputation in backward is made to replay the plan from `k` (`_replay`); what cannot
        be replayed is refused. Nothing while replaying."""
        if self.replaying:
            return
        frame = checkpoint_frame()
        region = frame if frame is not None else reentrant_context()
        if region is None or self.no_recompute:
            self._refuse_checkpointed(k)
        if region in self.regions:
            return
        if nested_checkpoint():
            self.no_recompute = NESTED
            self._refuse_checkpointed(k)
        self.regions.add(region)
        if frame is None:  # (reentrant: its backward runs a backward of its own)
            if self.reentrant_refused:
                self.no_recompute = self.reentrant_refused
                self._refuse_checkpointed(k)
            self.defer_count = False  # (that backward's gradients get no loss count factor)
            state = comm.draw_state() if region.preserve_rng_state else None
            around_rerun(region, lambda run: self._replay(k, state, run))
            return
        state = comm.draw_state() if preserves_rng(frame) else None  # (before its first draw)
        around_recomputation(frame, lambda run: self._replay(k, state, run))

    def _replay(self, k: int, state: Any, run: Callable[[], None]) -> None:
        """A checkpointed region's recomputation (`run`, in backward): its ops are the plan's
        nodes from `k` on, carried out as in the forward (moves, collectives, sizes) by an
        executor of this plan positioned at `k`, its dropouts drawing from the generator state
        the forward drew from (`state`: the same global masks; None: from the current state,
        as torch's recomputation with ``preserve_rng_state=False`` draws)."""
        replay = self.fresh()
        replay.cursor, replay.start, replay.run = k, -1, self.run
        replay.backward_seen = replay.replaying = True  # (a mismatch raises: no new plan)
        now = comm.draw_state() if state is not None else None
        if state is not None:
            comm.set_draw_state(state)
        name = self.plan.nodes[k].name
        self.replay = replay  # (primitives' module hooks reach this executor: they go to it)
        try:
            with recorder.phase("backward"), recorder.label(f"recompute from {name}"):
                if self.fill_weights is not None:  # (before torch's recomputation mode)
                    self.fill_weights(self._weights_read(k))
                with replay, packing_around(replay._unmatched):
                    run()
        finally:
            self.replay = None
            if now is not None:
                comm.set_draw_state(now)

    def _unmatched(self, call: Callable[[], Any]) -> Any:
        """``call()`` with this executor paused: its ops pass unexamined, no plan node (a
        saved-tensor pack hook; the executor's own callbacks, `_paused_call`)."""
        self.paused += 1
        try:
            return call()
        finally:
            self.paused -= 1

    def _weights_read(self, k: int) -> list[str]:
        """The parameters the nodes of the region that starts at node `k` read."""
        nodes = next((r.replayed() for r in self.plan.regions if r.first == k), range(k, k + 1))
        return [
            v.split(":", 1)[1]
            for i in nodes
            for v in self.plan.nodes[i].values
            if v.startswith("param:")
        ]

    def _refuse_checkpointed(self, k: int) -> NoReturn:
        """Raise: node `k` runs inside activation checkpointing that cannot be replayed
        (`no_recompute` says why; else no region could be found for it)."""
        node = self.plan.nodes[k]
        why = self.no_recompute or (
            "its recomputation in backward cannot be found to replay the plan there"
        )
        raise UnsupportedParallelError(
            f"AutoParallel: %{k} {node.name} ({node.op}) runs inside activation checkpointing "
            f"(torch.utils.checkpoint): {why}"
        )
