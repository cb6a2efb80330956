"""Apply and run on this rank: parameter blocks, an op's own collectives, gradient reduction.

- `shard_parameters` (step 2, apply): replaces each consumed parameter's data by this rank's
  block, cut with `redistribute` from the replicated layout (local slices only, no collective;
  the coordinates are computed from the rank, so it also works in a simulated world); a network
  built inside ``sw.no_init_parameters()`` instead materializes only this rank's blocks
  (`_delayed.materialize_blocks`).
- `combine` (run): one collective an op's strategy implies (`AllReduce` sum / mean / max,
  `ReduceScatter`, ...), with the autograd-aware primitives of `shardwise.communication`.
- `cut_optimizer_state`: optimizer state made before the cut (Adagrad), cut the same way.
- Step 4 (the gradients' fused AllReduces without optimizer parallel) is `_grad_buckets`.

Groups (`group_for`) are named by the matrix, the axes and the ranks, the same on every rank. In
a real job each rank creates the group it belongs to; in a simulated world the group holding
rank 0 is created and its translates run at once (`communication.own_group`; the matrix must
use the default rank_list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.communication.primitives import GradRoute, sum_over_ranks
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.parallel._delayed import has_deferred, materialize_blocks
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.redistribution import local_block

Shape = tuple[int, ...]


def replicated_layout(matrix: DeviceMatrix, ndim: int) -> TensorLayout:
    """Every dim whole on every rank."""
    return TensorLayout(matrix, ((),) * ndim)


def group_for(matrix: DeviceMatrix, axes: Sequence[int]) -> tuple[str | None, tuple[int, ...]]:
    """This rank's group along `axes` of `matrix` (None: the world) and its members, ordered by
    coordinate (first axis outer). Created on first use (`communication.own_group`: in a
    simulated world rank 0's group, which runs on its translates too)."""
    members = comm.own_group(lambda r: matrix.group_along(r, tuple(axes)))
    ranks = tuple(sorted(members))
    if len(ranks) == comm.get_group_size():
        return None, members
    names = ",".join(matrix.names[a] for a in axes)
    name = comm.scoped_group_name(f"parallel:{names}", str(matrix), ranks)
    return comm.ensure_group(name, ranks), members


def combine(
    x: torch.Tensor,
    kind: str,
    op: str,
    dim: int | None,
    matrix: DeviceMatrix,
    axes: Sequence[int],
    what: object,
    route: GradRoute | None = None,
) -> torch.Tensor:
    """An op's own collective over `axes` of `matrix`: ``"AllReduce"`` (`op` ``"sum"``,
    ``"mean"`` or ``"max"``: `communication.max_over_ranks`; its adjoint as `route` says) or
    ``"ReduceScatter"`` (``"sum"``, cutting `dim`); `what` names it in errors."""
    group, members = group_for(matrix, axes)
    if len(members) == 1:
        return x
    if kind == "AllReduce" and op == "max":
        return comm.max_over_ranks(x, group, route)
    if kind == "AllReduce":
        return sum_over_ranks(x, group, len(members) if op == "mean" else 1, route)
    if kind == "ReduceScatter" and op == "sum" and dim is not None:
        rows = x.movedim(dim, 0)
        ranks = sorted(members)
        if ranks != list(members):  # (axes inner first: the group's k-th rank gets its chunk)
            chunks = rows.chunk(len(members))
            rows = torch.cat([chunks[members.index(r)] for r in ranks])
        out: torch.Tensor = comm.ReduceScatter("sum", group)(rows)
        return out.movedim(0, dim)
    raise UnsupportedParallelError(f"collective {what} is not supported yet")


def _owner(network: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (network.get_submodule(path) if path else network), attr


def shard_parameters(network: nn.Module, params: Mapping[str, tuple[TensorLayout, Shape]]) -> None:
    """Replace each parameter's data by this rank's block of it (same Parameter objects, so an
    optimizer built before still holds them).

    A network built inside ``sw.no_init_parameters()`` is materialized here instead, each rank
    keeping only its blocks (`materialize_blocks`: each tensor is generated, cut and freed in
    turn, so no rank holds the whole replicated model).
    """
    if has_deferred(network):
        materialize_blocks(network, params)
        return
    for name, (layout, shape) in params.items():
        owner, attr = _owner(network, name)
        p = getattr(owner, attr)
        if tuple(p.shape) != tuple(shape):
            raise ValueError(f"parameter {name!r} has shape {list(p.shape)}, planned {shape}")
        with torch.no_grad():
            full = p.detach()
            block = local_block(full, layout, shape)
            p.set_(block.clone())  # keeps the Parameter object (`.data =` ignores LocalTensors)


def cut_optimizer_state(
    network: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    params: Mapping[str, tuple[TensorLayout, Shape]],
) -> None:
    """Cut state that `optimizers` made before the parameters were cut to their blocks
    (``Adagrad`` fills ``sum`` at construction) to this rank's block, like the parameters."""
    names = {id(p): n for n, p in network.named_parameters()}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            name = names.get(id(p))
            if name is None or name not in params:
                continue
            layout, shape = params[name]
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and tuple(value.shape) == shape != p.shape:
                    with torch.no_grad():
                        state[key] = local_block(value, layout, shape).clone()
