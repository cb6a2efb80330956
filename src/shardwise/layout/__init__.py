"""Layout algebra: device matrices with named axes and tensor layouts on them.

- `_core`: `DeviceMatrix` (rank <-> coordinate, axis groups), `TensorLayout` (which axes split
  which dim, each rank's block).
"""

from shardwise.layout._core import DeviceMatrix, TensorLayout

__all__ = ["DeviceMatrix", "TensorLayout"]
