"""Layouts written with axis names, as MindSpore's ``layout("mp", ("sp", "dp"))``."""

from __future__ import annotations

from shardwise.layout import DeviceMatrix, TensorLayout

MATRIX = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))

Alias = str | tuple[str, ...] | None


def lay(*aliases: Alias, matrix: DeviceMatrix = MATRIX) -> TensorLayout:
    """``lay("mp", ("sp", "dp"), None)``: a layout from one alias (or tuple, or None) per dim."""

    def axes(alias: Alias) -> tuple[int, ...]:
        if alias is None or alias == "None":
            return ()
        names = (alias,) if isinstance(alias, str) else alias
        return tuple(matrix.axis(n) for n in names)

    return TensorLayout(matrix, tuple(axes(a) for a in aliases))
