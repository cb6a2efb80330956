"""DTensor's sharding strategies for aten ops, queried without a process group.

torch 2.13's DTensor keeps its per-op sharding rules in a private propagator
(``DTensor._op_dispatcher.sharding_propagator``); this module is the only place that touches
it (checked by tests/test_torch_private_apis.py).

- `mesh_of`: a `DeviceMesh` of a device matrix's shape built without any process group.
- `has_rule`: whether DTensor knows an aten op.
- `propagate`: the placements DTensor wants for an op's tensor arguments, given theirs, and the
  placements of its outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import _pytree as pytree

Placements = tuple[Placement, ...]


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


@functools.lru_cache(maxsize=64)
def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], ranks: tuple[int, ...]) -> DeviceMesh:
    """A mesh of `shape` (`ranks` row-major, dims named `names`); no process group is made."""
    grid = torch.tensor(ranks, dtype=torch.int64).view(shape)
    return DeviceMesh("cpu", grid, mesh_dim_names=names, _init_backend=False, _rank=ranks[0])


def has_rule(op: Any) -> bool:
    """Whether DTensor has a sharding strategy for aten overload `op`."""
    p = _propagator()
    return op in p.op_strategy_funcs or op in p.op_single_dim_strategy_funcs or op in p.op_to_rules


def rule_count() -> int:
    """How many aten overloads DTensor has a sharding strategy for."""
    p = _propagator()
    keys = set(p.op_strategy_funcs) | set(p.op_single_dim_strategy_funcs) | set(p.op_to_rules)
    return len(keys)


class Spec:
    """A tensor argument for `propagate`: placements, global shape, stride and dtype."""

    def __init__(
        self, placements: Placements, shape: Sequence[int], stride: Sequence[int], dtype: str
    ) -> None:
        self.placements = placements
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        self.dtype = dtype


def _spec(mesh: DeviceMesh, s: Spec) -> DTensorSpec:
    meta = TensorMeta(torch.Size(s.shape), s.stride, getattr(torch, s.dtype))
    return DTensorSpec(mesh, s.placements, meta)


def propagate(
    op: Any, args: Sequence[Any], kwargs: Mapping[str, Any], mesh: DeviceMesh
) -> tuple[list[Placements], list[Placements | None]]:
    """DTensor's choice for one aten call.

    Args:
        op: the aten overload.
        args / kwargs: its arguments, each tensor given as a `Spec`.
        mesh: from `mesh_of`.

    Returns:
        (the placements each `Spec` argument must have, in pytree order; the placements of each
        of the op's outputs, None for a non-tensor output).

    Raises:
        RuntimeError / NotImplementedError: DTensor's own (no rule; an uneven split it refuses).
    """
    a, k = pytree.tree_map_only(Spec, lambda s: _spec(mesh, s), (tuple(args), dict(kwargs)))
    p = _propagator()
    # (as DTensor's dispatcher does: the schema info makes the non-tensor arguments, such as a
    # view's sizes, part of the key of the propagator's cache)
    info = p.op_to_schema_info.get(op) or p.op_to_schema_info_for_single_dim_strategy.get(op)
    out = p.propagate_op_sharding(OpSchema(op, a, k, schema_info=info))
    given = [s for s in pytree.tree_leaves((a, k)) if isinstance(s, DTensorSpec)]
    wanted = given
    if out.needs_redistribute and out.redistribute_schema is not None:
        schema = out.redistribute_schema
        wanted = [
            s
            for s in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
            if isinstance(s, DTensorSpec)
        ]
    outs = out.output_spec
    flat = list(outs) if isinstance(outs, tuple | list) else [outs]
    return (
        [tuple(s.placements) for s in wanted],
        [None if s is None else tuple(s.placements) for s in flat],
    )
