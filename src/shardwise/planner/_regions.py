"""Activation-checkpointed regions of a captured step: which ops backward runs again.

``torch.utils.checkpoint`` keeps a region's inputs only and runs its function again in
backward; the plan's executor replays the region's nodes there (`parallel/_recompute.py`), with
their moves and collectives. How far the replay goes is torch's rule: a reentrant region, or a
non-reentrant one with early stop off (``set_checkpoint_early_stop(False)``), runs every op; a
non-reentrant one stops inside the op that saves the region's last tensor for backward (the
ops after it, and that op's own collectives after its compute, do not run again: a
collective an op runs before the compute that saves, a split-feature norm's statistics, is
then left out).

- `Region`: one region's nodes and how far its replay goes (`ParallelPlan.regions`).
- `RegionNotes`: what the capture notes while the step runs (`note`, per recorded node, with
  whether it saved tensors, `saved_before` / `saved_since`) and the regions it found
  (`regions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise._torch.checkpointing import (
    checkpoint_frame,
    in_activation_checkpoint,
    reentrant_context,
    saved_count,
    stops_early,
)


@dataclass(frozen=True)
class Region:
    """One checkpointed region: nodes `first` to `last`, in execution order.

    Attributes:
        first / last: its first and last node.
        until: the last node whose inputs backward moves again (-1: none: the region saved
            nothing, so nothing is recomputed).
        full: the replay runs every node, its own collectives too (reentrant, or no early
            stop); else it stops inside node `until`, after its input moves and before its
            own collectives.
        reentrant: ``use_reentrant=True``.
    """

    first: int
    last: int
    until: int
    full: bool
    reentrant: bool = False

    def replayed(self) -> range:
        """The nodes whose input moves backward runs again."""
        return range(self.first, self.until + 1)

    def runs_own(self, index: int) -> bool:
        """Whether the replay runs node `index`'s own collectives (a primitive's AllReduce)."""
        return self.first <= index <= self.until and (self.full or index < self.until)

    def __str__(self) -> str:
        how = "reentrant" if self.reentrant else "non-reentrant"
        if self.until < self.first:
            again = "nothing recomputed (it saves no tensor)"
        elif self.full:
            again = "every op recomputed in backward"
        else:
            again = f"recomputed in backward up to %{self.until} (early stop)"
        return f"checkpointed %{self.first}-%{self.last} ({how}): {again}"


class RegionNotes:
    """The capture's notes on checkpointed regions (see the module docstring)."""

    def __init__(self) -> None:
        self._keys: dict[int, int] = {}  # id(region object) -> its number
        self._kept: list[Any] = []  # (the region objects, so that no id is reused)
        self._nodes: list[list[int]] = []  # per region: its nodes
        self._savers: list[list[int]] = []  # per region: its nodes that saved tensors
        self._how: list[tuple[bool, bool]] = []  # per region: (reentrant, stops early)

    def saved_before(self) -> int | None:
        """Before an op runs: the tensors its non-reentrant region saved so far (None: not in
        one)."""
        if not in_activation_checkpoint():
            return None
        frame = checkpoint_frame()
        return None if frame is None else saved_count(frame)

    def note(self, index: int, before: int | None) -> None:
        """Node `index` was recorded; `before`: `saved_before` of its op (None: unknown, taken
        as saving)."""
        if not in_activation_checkpoint():
            return
        frame = checkpoint_frame()
        region = frame if frame is not None else reentrant_context()
        if region is None:
            return
        number = self._keys.get(id(region))
        if number is None:
            number = self._keys[id(region)] = len(self._nodes)
            self._kept.append(region)
            self._nodes.append([])
            self._savers.append([])
            early = frame is not None and stops_early(frame)
            self._how.append((frame is None, early))
        self._nodes[number].append(index)
        if frame is None or before is None or saved_count(frame) > before:
            self._savers[number].append(index)

    def regions(self) -> tuple[Region, ...]:
        """Every region noted, in order."""
        out = []
        for nodes, savers, (reentrant, early) in zip(
            self._nodes, self._savers, self._how, strict=True
        ):
            first, last = nodes[0], nodes[-1]
            if early:
                until = savers[-1] if savers else -1
                out.append(Region(first, last, until, False, reentrant))
            else:  # (non-reentrant: recomputed only when a saved tensor is unpacked)
                until = last if reentrant or savers else -1
                out.append(Region(first, last, until, True, reentrant))
        return tuple(out)


__all__ = ["Region", "RegionNotes"]
