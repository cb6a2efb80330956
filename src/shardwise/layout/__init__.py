"""Layout algebra: device matrices with named axes and tensor layouts on them.

- `_core`: `DeviceMatrix` (rank <-> coordinate, axis groups), `TensorLayout` (which axes split
  which dim, each rank's block).
- `_layout`: `Layout` (``sw.Layout``: named device matrix, call form ``layout("mp", ("sp",
  "dp"))``), `strided` (``sw.strided``: a dim cut into groups, each split over the axes),
  MindSpore ``tensor_map`` conversion and dicts for strategy files.
- `_strategy`: int / Layout strategies -> a primitive's device matrix and input layouts (repeat
  factor appended on the right), with every validation error.
- `_rules`: helpers for primitives' rules (`elementwise_axes`, `data_parallel_strategy`).
- `_refine`: `common_refinement` / `refine`: many primitives' matrices as one global mesh.
- `_dtensor`: `to_placements` / `from_placements` (``Shard`` / ``_StridedShard`` /
  ``Replicate``) and `device_mesh_for`.
"""

from shardwise.layout._core import DeviceMatrix, TensorLayout
from shardwise.layout._dtensor import device_mesh_for, from_placements, split_factor, to_placements
from shardwise.layout._layout import (
    NONE,
    DimSpec,
    Layout,
    LayoutTypeError,
    Strided,
    strided,
    tensor_layout_from_dict,
    tensor_layout_to_dict,
    tensor_map,
)
from shardwise.layout._refine import axis_runs, common_refinement, refine
from shardwise.layout._rules import data_parallel_strategy, elementwise_axes, iter_rank_slices
from shardwise.layout._strategy import (
    REPEAT,
    AxisMap,
    IntStrategy,
    StrategyLayouts,
    check_int_strategy,
    check_layout_strategy,
    resolve_strategy,
    scalar_layouts,
    strategy_kind,
    strategy_layouts,
)

__all__ = [
    "NONE",
    "REPEAT",
    "AxisMap",
    "DeviceMatrix",
    "DimSpec",
    "IntStrategy",
    "Layout",
    "LayoutTypeError",
    "StrategyLayouts",
    "Strided",
    "TensorLayout",
    "axis_runs",
    "check_int_strategy",
    "check_layout_strategy",
    "common_refinement",
    "data_parallel_strategy",
    "device_mesh_for",
    "elementwise_axes",
    "from_placements",
    "iter_rank_slices",
    "refine",
    "resolve_strategy",
    "scalar_layouts",
    "split_factor",
    "strategy_kind",
    "strategy_layouts",
    "strided",
    "tensor_layout_from_dict",
    "tensor_layout_to_dict",
    "tensor_map",
    "to_placements",
]
