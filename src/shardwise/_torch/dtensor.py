"""DTensor internals: ``_StridedShard`` and the sharding propagator, asked without a process
group.

- `StridedShard`: DTensor's placement for a dim split over several mesh dims in an order other
  than the mesh's (`layout/_dtensor.py`, `ops/aten_rules.py`, `ops/_dtensor.py`).
- `mesh_without_process_group`: a ``DeviceMesh`` that creates no process group, so that
  planners ask DTensor about meshes of any size in one process.
- `has_rule`, `has_single_dim_rule`, `rule_count`, `ask_propagator`: DTensor keeps its per-op
  sharding rules in a private propagator (``DTensor._op_dispatcher.sharding_propagator``);
  `ops/_dtensor.py` asks it for the placements of an aten call (memoized there).
- `tensor_spec`: the propagator's description of one tensor argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

StridedShard = _StridedShard
Placements = tuple[Placement, ...]


def sharding_propagator() -> Any:
    """DTensor's sharding propagator (its rule tables and its cached propagation)."""
    return DTensor._op_dispatcher.sharding_propagator


def mesh_without_process_group(
    shape: tuple[int, ...], names: tuple[str, ...], ranks: tuple[int, ...]
) -> DeviceMesh:
    """A mesh of `shape` (`ranks` row-major, dims named `names`); no process group is made."""
    grid = torch.tensor(ranks, dtype=torch.int64).view(shape)
    return DeviceMesh("cpu", grid, mesh_dim_names=names, _init_backend=False, _rank=ranks[0])


def has_rule(op: Any) -> bool:
    """Whether DTensor has a sharding strategy for aten overload `op`."""
    p = sharding_propagator()
    return op in p.op_strategy_funcs or op in p.op_single_dim_strategy_funcs or op in p.op_to_rules


def has_single_dim_rule(op: Any) -> bool:
    """Whether DTensor describes `op` per mesh dim (its full-mesh strategies are the cartesian
    product of single-dim ones)."""
    return op in sharding_propagator().op_single_dim_strategy_funcs


def rule_count() -> int:
    """How many aten overloads DTensor has a sharding strategy for."""
    p = sharding_propagator()
    keys = set(p.op_strategy_funcs) | set(p.op_single_dim_strategy_funcs) | set(p.op_to_rules)
    return len(keys)


def tensor_spec(
    mesh: DeviceMesh,
    placements: Placements,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: str,
) -> DTensorSpec:
    """A tensor argument as the propagator takes it (`dtype` named as in ``torch.float32``)."""
    meta = TensorMeta(torch.Size(shape), stride, getattr(torch, dtype))
    return DTensorSpec(mesh, placements, meta)


def ask_propagator(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Placements], list[Placements | None]]:
    """DTensor's choice for one aten call whose tensor arguments are `tensor_spec`s: the
    placements each must have (pytree order), and those of each output (None: not a tensor).

    Raises:
        RuntimeError / NotImplementedError: DTensor's own (no rule; an uneven split it refuses).
    """
    p = sharding_propagator()
    # (as DTensor's dispatcher does: the schema info makes the non-tensor arguments, such as a
    # view's sizes, part of the key of the propagator's cache)
    info = p.op_to_schema_info.get(op) or p.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args, kwargs, schema_info=info)
    shaped = p.op_to_shape_and_stride_idx
    if op in shaped:
        # (DTensor then rewrites a view's size arguments to the local shape: placements do not
        # depend on it, and on a mesh of 1,024 ranks it costs 0.1 s a query. Asked uncached
        # and without it; the caller memoizes the answer; the rule is put back before returning.)
        held = shaped.pop(op)
        try:
            out = p.propagate_op_sharding_non_cached(schema)
        finally:
            shaped[op] = held
    else:
        out = p.propagate_op_sharding(schema)
    wanted = _specs((args, kwargs))
    if out.needs_redistribute and out.redistribute_schema is not None:
        moved = out.redistribute_schema
        wanted = _specs((moved.args_schema, moved.kwargs_schema))
    outs = out.output_spec
    flat: list[Any] = list(outs) if isinstance(outs, tuple | list) else [outs]
    return (
        [tuple(s.placements) for s in wanted],
        [None if s is None else tuple(s.placements) for s in flat],
    )


def _specs(tree: Any) -> list[DTensorSpec]:
    return [s for s in pytree.tree_leaves(tree) if isinstance(s, DTensorSpec)]
