"""Small AllReduce(SUM)s that ride on a larger one over the same ranks (`Carpool`).

The parallel runtime's loss AllReduce is a few bytes, yet on its own it costs a whole collective
(a round trip, and a hand-off to the process group's worker thread on every rank). When the
step's gradient AllReduce over the same ranks comes after it, the small value waits instead:

1. `Carpool.seat` (called by `sum_over_ranks` with a pool) takes the value, not yet reduced.
2. `Carpool.all_reduce_async` (called by `GradBuckets` for a bucket) copies the waiting values
   of that group and dtype into the spare room after the bucket's elements and starts one
   AllReduce over both.
3. `Seat.finish` (called by the owner of the value before it is read) waits for that AllReduce
   and copies the sums back; a value no bucket took runs its own AllReduce there.

A carried value is still recorded as its own AllReduce (its elements, the phase and label of
its seat, no time), with `CommRecord.carrier` naming the bucket whose message carried it; the
bucket's record counts the bucket's elements only. So the communication report lists the same
collectives and bytes either way, and says which ones shared a message.
"""

from __future__ import annotations

import torch

from shardwise.communication import _collectives as C
from shardwise.communication import recorder
from shardwise.communication._collectives import Pending, ReduceOp, deferred_record
from shardwise.communication._init import Group, resolve_group


class Seat:
    """One waiting value (`value`, reduced in place) and, once boarded, where it rides."""

    def __init__(self, pool: Carpool, value: torch.Tensor, group: str | Group | None) -> None:
        self.pool, self.value, self.group = pool, value, group
        g = resolve_group(group)
        self.ranks = g.ranks
        self.pending: Pending[torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None
        self.carrier = ""  # (the label of the bucket it rides on)
        self.phase, self.label = recorder.current()  # (recorded as if started here)
        self.record = deferred_record("AllReduce", g, value.dtype, value.numel(), 0.0)

    def finish(self) -> torch.Tensor:
        """The value summed over its group: from the bucket it rode on, else its own
        AllReduce now."""
        value = self.value
        # (in place, also on a value made under inference_mode)
        with torch.inference_mode(value.is_inference()), torch.no_grad():
            if self.pending is None:
                self.pool.leave(self)
                with recorder.phase(self.phase), recorder.label(self.label):
                    return C.all_reduce_(value, ReduceOp.SUM, self.group)
            assert self.slot is not None
            self.pending.wait()
            value.copy_(self.slot.view_as(value))
        self.pending = self.slot = None
        self.record(self.carrier)
        return value


class Carpool:
    """The values waiting for a bucket (see the module docstring).

    Args:
        groups: the groups the buckets reduce over; a value over other ranks is not seated.
    """

    SPARE = 16  # elements of spare room a bucket's buffer keeps for riders

    def __init__(self, groups: list[str | Group | None]) -> None:
        self.ranks = {resolve_group(g).ranks for g in groups}
        self.waiting: list[Seat] = []

    def seat(self, value: torch.Tensor, group: str | Group | None) -> Seat | None:
        """Seat contiguous `value` (None: no bucket reduces over its group, or it is too big)."""
        if value.numel() > self.SPARE or not value.is_contiguous():
            return None
        if resolve_group(group).ranks not in self.ranks:
            return None
        seat = Seat(self, value, group)
        self.waiting.append(seat)
        return seat

    def leave(self, seat: Seat) -> None:
        if seat in self.waiting:
            self.waiting.remove(seat)

    def all_reduce_async(
        self, flat: torch.Tensor, used: int, group: str | Group | None
    ) -> Pending[torch.Tensor]:
        """Start the AllReduce(SUM) of ``flat[:used]`` (a bucket; recorded as `used` elements
        under the current label), with the waiting values of `group` and `flat`'s dtype riding
        in ``flat[used:]`` as far as it has room."""
        seats, end = [], used
        ranks = resolve_group(group).ranks
        for seat in list(self.waiting):
            n = seat.value.numel()
            if seat.ranks != ranks or seat.value.dtype != flat.dtype or end + n > flat.numel():
                continue
            seat.slot = flat[end : end + n]
            with torch.no_grad():
                seat.slot.copy_(seat.value.reshape(-1))
            end += n
            seats.append(seat)
            self.waiting.remove(seat)
        pending = C.all_reduce_async(flat[:end], ReduceOp.SUM, group, numel=used)
        carrier = recorder.current()[1] or "a gradient bucket"
        for seat in seats:
            seat.pending, seat.carrier = pending, carrier
        return pending
