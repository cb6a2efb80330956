"""The user-facing `Layout`: MindSpore's named device matrix and its call form.

``Layout((2, 2, 2), ("dp", "sp", "mp"))`` names the axes of a `DeviceMatrix`;
``layout("mp", ("sp", "dp"))`` says, for each tensor dim, which axes split it and returns a
`TensorLayout` (`Layout.__call__`, which parses every argument with `_parse_dim`).

`tensor_map` / `tensor_layout_to_dict` / `tensor_layout_from_dict` convert a `TensorLayout` to and
from MindSpore's ``tensor_map`` form (axis indices counted from the right, ``-1`` = not split), the
form strategy files use; `Layout.to_dict` / `Layout.from_dict` do the same for the device matrix.

Wrong types raise `LayoutTypeError`, which is both a `TypeError` (as in MindSpore) and a
`ValueError` (as every other layout error).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from shardwise.layout._core import DeviceMatrix, TensorLayout

NONE = "None"
"""The alias that means "this tensor dim is not split"."""

DimSpec: TypeAlias = str | tuple[str, ...] | None
"""One argument of a layout call: an alias, ``"None"`` (or ``None``), or a tuple of aliases."""

TensorMapEntry: TypeAlias = int | tuple[int, ...]


class LayoutTypeError(TypeError, ValueError):
    """A layout or strategy argument of the wrong type (catchable as TypeError or ValueError)."""


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    """`value` as a tuple of ints (a list or tuple of non-bool ints), else LayoutTypeError."""
    if not isinstance(value, tuple | list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise LayoutTypeError(f"{what} must be a tuple of ints, got {value!r}")
    return tuple(value)


def _check_aliases(shape: tuple[int, ...], alias_name: object) -> tuple[str, ...]:
    """Validate alias names against the device-matrix shape; return them as a tuple."""
    if not isinstance(alias_name, tuple | list) or any(not isinstance(a, str) for a in alias_name):
        raise LayoutTypeError(f"alias_name must be a tuple of str, got {alias_name!r}")
    names = tuple(alias_name)
    if len(names) != len(shape):
        raise ValueError(
            f"device_matrix {shape} has {len(shape)} axes but alias_name {names} has "
            f"{len(names)} names; give one alias per axis"
        )
    for name in names:
        if not name or name == NONE:
            raise ValueError(f"alias {name!r} in {names} is reserved or empty; pick another name")
        if name == "interleaved_parallel":
            raise ValueError("alias 'interleaved_parallel' is not supported by shardwise")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"alias_name {names} repeats {dup}; every axis needs its own alias")
    return names


@dataclass(frozen=True, init=False)
class Layout:
    """A device matrix with named axes; call it to lay out a tensor (MindSpore's ``Layout``).

    Attributes:
        matrix: the `DeviceMatrix` (shape, alias names, rank list).

    Example:
        >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        >>> x = layout("mp", ("sp", "dp"))       # dim 0 by mp, dim 1 by sp (outer) and dp
        >>> x.dims, x.local_shape((32, 784))
        (((2,), (1, 0)), (16, 196))
    """

    matrix: DeviceMatrix

    def __init__(
        self,
        device_matrix: Sequence[int],
        alias_name: Sequence[str],
        rank_list: Sequence[int] | None = None,
    ) -> None:
        """Build the device matrix.

        Args:
            device_matrix: size of every axis, slowest first, e.g. ``(2, 2, 2)``.
            alias_name: one distinct name per axis, e.g. ``("dp", "sp", "mp")``.
            rank_list: the global rank at each position of the matrix (row-major); default
                ``0 .. prod(device_matrix) - 1``.

        Raises:
            LayoutTypeError: an argument of the wrong type.
            ValueError: sizes < 1, alias count != axis count, repeated / empty / ``"None"``
                aliases, or a rank list whose length is not the product of the matrix.
        """
        shape = _int_tuple(device_matrix, "device_matrix")
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"device_matrix {shape}: give at least one axis, every size >= 1")
        names = _check_aliases(shape, alias_name)
        ranks = () if rank_list is None else _int_tuple(rank_list, "rank_list")
        size = DeviceMatrix(shape, names).size
        if rank_list is not None and len(ranks) != size:
            raise ValueError(
                f"rank_list has {len(ranks)} ranks but device_matrix {shape} holds {size} "
                f"devices (its product); give exactly {size} ranks"
            )
        object.__setattr__(self, "matrix", DeviceMatrix(shape, names, ranks))

    @property
    def device_matrix(self) -> tuple[int, ...]:
        return self.matrix.shape

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self.matrix.names

    @property
    def rank_list(self) -> tuple[int, ...]:
        return self.matrix.rank_list

    def __call__(self, *tensor_map: DimSpec) -> TensorLayout:
        """Lay out a tensor: one argument per tensor dim.

        Args:
            *tensor_map: per dim, an alias (split by that axis), ``"None"`` / ``None`` (not
                split) or a tuple of aliases (split by all of them, the first outer).

        Returns:
            The `TensorLayout` on this device matrix.

        Raises:
            ValueError: an unknown alias (the message lists the known ones), an alias used
                twice, an empty tuple; LayoutTypeError for anything that is not a str or tuple.

        Example:
            >>> Layout((2, 4), ("dp", "mp"))("dp", "None").dims
            ((0,), ())
        """
        dims = tuple(self._parse_dim(spec, i, tensor_map) for i, spec in enumerate(tensor_map))
        seen: dict[int, int] = {}
        for d, axes in enumerate(dims):
            for a in axes:
                if a in seen:
                    raise ValueError(
                        f"layout{_call_str(tensor_map)}: alias {self.matrix.names[a]!r} is used "
                        f"by dims {seen[a]} and {d}; each alias may split a tensor only once"
                    )
                seen[a] = d
        return TensorLayout(self.matrix, dims)

    def _parse_dim(self, spec: object, dim: int, call: tuple[object, ...]) -> tuple[int, ...]:
        """The axes that split tensor dim `dim` according to `spec` (outer first)."""
        where = f"layout{_call_str(call)}, dim {dim}"
        if spec is None or spec == NONE:
            return ()
        if isinstance(spec, str):
            return (self._axis(spec, where),)
        if not isinstance(spec, tuple) or any(not isinstance(s, str) for s in spec):
            raise LayoutTypeError(
                f"{where}: expected an alias, 'None' or a tuple of aliases, got {spec!r}"
            )
        if not spec:
            raise ValueError(f"{where}: empty tuple; use 'None' for a dim that is not split")
        if NONE in spec:
            raise ValueError(f"{where}: 'None' cannot be part of a tuple {spec}")
        return tuple(self._axis(s, where) for s in spec)

    def _axis(self, name: str, where: str) -> int:
        if name not in self.matrix.names:
            raise ValueError(
                f"{where}: unknown alias {name!r}; this layout's aliases are "
                f"{list(self.matrix.names)} (or 'None')"
            )
        return self.matrix.names.index(name)

    def to_dict(self) -> dict[str, list[int] | list[str]]:
        """``{"device_matrix": [...], "alias_name": [...], "rank_list": [...]}`` (JSON-ready)."""
        return {
            "device_matrix": list(self.device_matrix),
            "alias_name": list(self.alias_name),
            "rank_list": list(self.rank_list),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """The inverse of `to_dict` (``rank_list`` may be missing)."""
        return cls(data["device_matrix"], data["alias_name"], data.get("rank_list"))

    @classmethod
    def of(cls, matrix: DeviceMatrix) -> Layout:
        """The `Layout` of an existing device matrix."""
        return cls(matrix.shape, matrix.names, matrix.rank_list)

    def __str__(self) -> str:
        return "Layout" + str(self.matrix).removeprefix("DeviceMatrix")

    def __repr__(self) -> str:
        ranks = (
            "" if self.rank_list == tuple(range(self.matrix.size)) else f", {list(self.rank_list)}"
        )
        return f"Layout({self.device_matrix}, {self.alias_name}{ranks})"


def _call_str(call: tuple[object, ...]) -> str:
    return "(" + ", ".join(repr(c) for c in call) + ")"


def tensor_map(layout: TensorLayout) -> tuple[TensorMapEntry, ...]:
    """MindSpore's ``tensor_map`` of `layout`: per dim, the index of the splitting axis counted
    from the RIGHT of the device matrix (the last axis is 0), a tuple for several axes, ``-1`` for
    a dim that is not split.

    Example:
        >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        >>> tensor_map(layout("dp", "mp")), tensor_map(layout("mp", ("sp", "dp")))
        ((2, 0), (0, (1, 2)))
    """
    last = len(layout.matrix.shape) - 1
    out: list[TensorMapEntry] = []
    for axes in layout.dims:
        if not axes:
            out.append(-1)
        elif len(axes) == 1:
            out.append(last - axes[0])
        else:
            out.append(tuple(last - a for a in axes))
    return tuple(out)


def tensor_layout_to_dict(layout: TensorLayout) -> dict[str, Any]:
    """A JSON-ready dict: `Layout.to_dict` plus ``"tensor_map"`` (see `tensor_map`; tuples
    become lists)."""
    tmap = [list(e) if isinstance(e, tuple) else e for e in tensor_map(layout)]
    return {**Layout.of(layout.matrix).to_dict(), "tensor_map": tmap}


def tensor_layout_from_dict(data: Mapping[str, Any]) -> TensorLayout:
    """The inverse of `tensor_layout_to_dict`.

    Raises:
        ValueError: a tensor_map entry that is not an axis index of the device matrix.
    """
    layout = Layout.from_dict(data)
    last = len(layout.device_matrix) - 1
    dims: list[tuple[int, ...]] = []
    for entry in data["tensor_map"]:
        idx = [entry] if isinstance(entry, int) else list(entry)
        if idx == [-1]:
            dims.append(())
            continue
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= last for i in idx):
            raise ValueError(f"tensor_map entry {entry!r} is not in 0..{last} or -1")
        dims.append(tuple(last - i for i in idx))
    return TensorLayout(layout.matrix, tuple(dims))
