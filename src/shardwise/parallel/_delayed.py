"""Step 2 for a network built inside ``sw.no_init_parameters()``: materialize only local blocks.

- `has_deferred`: whether a network still holds deferred (recorded, unallocated) tensors.
- `block_slicer`: the ``slicer(name, full_shape) -> index`` of one rank: a planned parameter
  keeps its layout's block (`TensorLayout.local_slice`), anything else stays whole.
- `materialize_blocks`: replays the recorded construction with that slicer, so each tensor is
  generated, cut to this rank's block and dropped before the next one is generated: a rank
  never holds more than its blocks plus the one full tensor being generated (the initializers
  draw a whole tensor from the RNG stream, which keeps values equal to the single-device run).

In a real job (or one process) the parameter objects are kept (`sw.parameter.materialize`), so
an optimizer built inside the block keeps working. In a simulated world every rank's block
differs: the tape is replayed once per rank outside the world, the blocks are joined with
``rank_map`` into per-rank tensors and put on the modules as new parameters (a per-rank tensor
cannot take over a plain Parameter object); optimizers that hold the old objects are re-pointed
to the new ones before their next step by a global step pre-hook (`_retarget`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwise.communication import _sim, get_rank
from shardwise.layout import TensorLayout
from shardwise.parameter import Slicer, is_deferred, materialize, materialized_values

Shape = tuple[int, ...]
Params = Mapping[str, tuple[TensorLayout, Shape]]


def has_deferred(network: nn.Module) -> bool:
    """Whether any parameter or buffer of `network` is a deferred (not materialized) tensor."""
    tensors = [*network.parameters(), *network.buffers()]
    return any(is_deferred(t) for t in tensors)


def block_slicer(params: Params, rank: int) -> Slicer:
    """`rank`'s slicer: planned parameters keep their block, other tensors stay whole."""

    def slicer(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        planned = params.get(name)
        if planned is None:
            return None
        layout, global_shape = planned
        if tuple(shape) != tuple(global_shape):
            raise ValueError(f"parameter {name!r} has shape {list(shape)}, planned {global_shape}")
        return layout.local_slice(rank, shape)

    return slicer


def materialize_blocks(network: nn.Module, params: Params) -> None:
    """Give every deferred tensor of `network` this rank's block (planned parameters) or its
    whole value (the rest), equal to the same block of the single-device initialization."""
    sim = _sim.current()
    if sim is None:
        rank = get_rank()
        assert isinstance(rank, int)
        materialize(network, slicer=block_slicer(params, rank))
        return
    _materialize_simulated(network, params, sim)


def _materialize_simulated(network: nn.Module, params: Params, sim: _sim.Simulator) -> None:
    with sim.outside():
        per_rank = [
            materialized_values(network, slicer=block_slicer(params, r))
            for r in range(sim.world_size)
        ]
    replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in per_rank[0]:
        value = sim.rank_map(_pick(per_rank, name))
        path, _, attr = name.rpartition(".")
        owner = network.get_submodule(path) if path else network
        old = getattr(owner, attr)
        if attr in owner._parameters:
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            setattr(owner, attr, new)
            replaced.append((old, new))
        else:
            persistent = attr not in owner._non_persistent_buffers_set
            owner.register_buffer(attr, value, persistent=persistent)
    _retarget(replaced)


def _pick(per_rank: list[dict[str, torch.Tensor]], name: str) -> Callable[[int], torch.Tensor]:
    return lambda r: per_rank[r][name]


_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
_HOOK: list[object] = []


def _retarget(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make optimizers holding an old parameter object step the new one instead."""
    for old, new in pairs:
        _REPLACED[id(old)] = (weakref.ref(old), weakref.ref(new))
    if pairs and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_step_pre_hook))


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if not _REPLACED:
        return
    for group in optimizer.param_groups:
        group["params"] = [_current(p) for p in group["params"]]
    for key in list(_REPLACED):
        old, new = _REPLACED[key]
        if old() is None or new() is None:
            del _REPLACED[key]


def _current(p: torch.Tensor) -> torch.Tensor:
    found = _REPLACED.get(id(p))
    if found is None or found[0]() is not p:
        return p
    new = found[1]()
    return p if new is None else new
