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
- `_given_meta`: the output metadata the planner captured, handed to the propagator instead of
  its own fake run of the op (``_propagate_tensor_meta_non_cached``: a ``FakeTensorMode`` made
  and the op run once per distinct query); only while `ask_propagator` asks, only in its thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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
OutMeta = tuple[tuple[int, ...], tuple[int, ...], str]
"""One tensor output's global shape, stride and dtype (named as in ``torch.float32``)."""


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
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: Sequence[OutMeta] | None = None,
) -> tuple[list[Placements], list[Placements | None]]:
    """DTensor's choice for one aten call whose tensor arguments are `tensor_spec`s: the
    placements each must have (pytree order), and those of each output (None: not a tensor).

    `outs`: the metadata of each tensor output (in order), when known: DTensor then takes it
    instead of running the op on fake tensors to learn it (`_given_meta`).

    Raises:
        RuntimeError / NotImplementedError: DTensor's own (no rule; an uneven split it refuses).
    """
    p = sharding_propagator()
    # (as DTensor's dispatcher does: the schema info makes the non-tensor arguments, such as a
    # view's sizes, part of the key of the propagator's cache)
    info = p.op_to_schema_info.get(op) or p.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args, kwargs, schema_info=info)
    meta = None if outs is None else _meta_tree(op, outs)
    if meta is None:
        return _ask(p, op, schema, args, kwargs)
    _install_given_meta()
    _given.pending = (schema, meta)
    try:
        return _ask(p, op, schema, args, kwargs)
    finally:
        _given.pending = None


def _ask(
    p: Any, op: Any, schema: OpSchema, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Placements], list[Placements | None]]:
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


_given = threading.local()  # (`pending`: (the schema asked, its metadata) in this thread)
_NO_META = object()


def _meta_tree(op: Any, outs: Sequence[OutMeta]) -> Any:
    """`outs` shaped as the propagator's fake run returns them (a `TensorMeta`; a tuple with
    None for each non-tensor return; a list for a ``Tensor[]`` return), or None when the
    schema leaves it open (an optional tensor, a list among other returns, too few outputs)."""
    metas = [TensorMeta(torch.Size(sh), tuple(st), getattr(torch, dt)) for sh, st, dt in outs]
    returns = [str(r.type) for r in op._schema.returns]
    if returns == ["List[Tensor]"]:
        return metas
    if any(t not in ("Tensor", "int", "float", "bool", "SymInt", "Scalar") for t in returns):
        return None
    tree: list[Any] = []
    it = iter(metas)
    for t in returns:
        tree.append(next(it, _NO_META) if t == "Tensor" else None)
    if _NO_META in tree or next(it, None) is not None or not returns:
        return None
    return tree[0] if len(returns) == 1 else tuple(tree)


def _install_given_meta() -> None:
    """Put `_given_meta` on DTensor's propagator in place of its fake run (once; it hands on
    to that fake run whenever this thread's `ask_propagator` gave no metadata)."""
    p = sharding_propagator()
    if getattr(p, "_propagate_tensor_meta_non_cached", None) is _given_meta:
        return
    if "_propagate_tensor_meta_non_cached" in vars(p):  # (someone else's: leave it alone)
        return
    p._propagate_tensor_meta_non_cached = _given_meta


def _given_meta(op_schema: OpSchema) -> Any:
    pending = getattr(_given, "pending", None)
    if pending is not None and pending[0] is op_schema:  # (not an op DTensor asks on the way)
        return pending[1]
    return type(sharding_propagator())._propagate_tensor_meta_non_cached(
        sharding_propagator(), op_schema
    )
