"""Step 2 for a network built inside ``sw.no_init_parameters()``: materialize only local blocks.

- `has_deferred`: whether a network still holds deferred (recorded, unallocated) tensors.
- `block_slicer`: the ``slicer(name, full_shape) -> index`` of one rank: a planned parameter
  keeps its layout's block (`TensorLayout.local_index`: a slice per dim, or the indices of a
  strided dim's rows in every group), anything else stays whole.
- `materialize_whole`: every deferred tensor whole on each rank (data-parallel mode, where
  every rank holds the whole network), the optimizers given pointed at once at the new
  parameter objects that per-rank values make (the runner plans over them before any step).
- `materialize_blocks`: replays the recorded construction with that slicer: a tensor is
  generated in chunks that advance the RNG stream exactly as the whole draw would (so values
  equal the single-device run) and only this rank's block is kept, so a rank holds its blocks
  plus a bounded buffer; a tensor whose fills cannot be chunked identically (or whose block is
  not one slice per dim, as a strided one) is generated whole, cut and dropped before the next
  one (see ``shardwise.parameter._blocks``).

The replay runs for each rank this process runs (`communication.rank_value`: its own rank in a
job) and `sw.parameter.materialize` gives the values to the network: in place, so an optimizer
built inside the block keeps working; a per-rank tensor (a process running every rank) cannot
take over a plain Parameter object, so the module gets a new parameter and optimizers holding
the old one are re-pointed to it before their next step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.layout import TensorLayout
from shardwise.parameter import Slicer, is_deferred, materialize, materialized_values
from shardwise.parameter._replace import repoint

Shape = tuple[int, ...]
Params = Mapping[str, tuple[TensorLayout, Shape]]


def has_deferred(network: nn.Module) -> bool:
    """Whether any parameter or buffer of `network` is a deferred (not materialized) tensor."""
    tensors = [*network.parameters(), *network.buffers()]
    return any(is_deferred(t) for t in tensors)


def block_slicer(params: Params, rank: int) -> Slicer:
    """`rank`'s slicer: planned parameters keep their block, other tensors stay whole."""

    def slicer(name: str, shape: tuple[int, ...]) -> tuple[slice | list[Any], ...] | None:
        planned = params.get(name)
        if planned is None:
            return None
        layout, global_shape = planned
        if tuple(shape) != tuple(global_shape):
            raise ValueError(f"parameter {name!r} has shape {list(shape)}, planned {global_shape}")
        return layout.local_index(rank, shape)

    return slicer


def materialize_blocks(network: nn.Module, params: Params) -> None:
    """Give every deferred tensor of `network` this rank's block (planned parameters) or its
    whole value (the rest), equal to the same block of the single-device initialization."""
    values = comm.rank_value(
        lambda rank: materialized_values(network, slicer=block_slicer(params, rank))
    )
    materialize(network, values=values)


def materialize_whole(network: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give every deferred tensor of `network` its whole value on each rank (`materialize_blocks`
    with no planned parameter) and point `optimizers` at the new objects now, if any."""
    if not has_deferred(network):
        return
    materialize_blocks(network, {})
    for optimizer in optimizers:
        repoint(optimizer)
