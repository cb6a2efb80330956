"""The user-facing `Layout`: MindSpore's named device matrix and its call form.

``Layout((2, 2, 2), ("dp", "sp", "mp"))`` names the axes of a `DeviceMatrix`;
``layout("mp", ("sp", "dp"))`` says, for each tensor dim, which axes split it and returns a
`TensorLayout` (`Layout.__call__`, which parses every argument with `_parse_dim`).
``layout(strided("mp", 3), "None")`` (`strided`, ``sw.strided``) cuts dim 0 into 3 equal groups
and splits each over mp: a fused q/k/v projection's rows, each rank holding its heads of all three.

`tensor_map` / `tensor_layout_to_dict` / `tensor_layout_from_dict` convert a `TensorLayout` to and
from MindSpore's ``tensor_map`` form (axis indices counted from the right, ``-1`` = not split), the
form strategy files use; `Layout.to_dict` / `Layout.from_dict` do the same for the device matrix.

Wrong types raise `LayoutTypeError`, which is both a `TypeError` (as in MindSpore) and a
`ValueError` (as every other layout error).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from shardwise.layout._core import DeviceMatrix, TensorLayout

NONE = "None"
"""The alias that means "this tensor dim is not split"."""


@dataclass(frozen=True)
class Strided:
    """A layout-call argument for a strided dim (made by `strided`): the dim is cut into
    `groups` equal groups, each split over `axes` (outer first), and each rank holds its block
    of every group, in group order (DTensor's ``_StridedShard``)."""

    axes: tuple[str, ...]
    groups: int

    def __repr__(self) -> str:
        axes = self.axes[0] if len(self.axes) == 1 else self.axes
        return f"strided({axes!r}, {self.groups})"


def strided(axes: str | Sequence[str], groups: int) -> Strided:
    """Split a dim over `axes` in `groups` interleaved groups: an argument of a layout call.

    The dim (size n) is viewed as ``groups`` consecutive groups of n / groups; each group is
    split over `axes` as a plain dim would be, and a rank holds its block of every group,
    concatenated in group order. For a fused projection whose outputs are ``[q; k; v]``
    (nanoGPT's ``c_attn``, ``nn.Linear(C, 3 * C)``), ``strided("mp", 3)`` on the weight's
    output dim gives each mp rank the same heads of q, k and v, so ``split(C, dim=-1)`` keeps
    all three split over mp with no communication.

    Args:
        axes: an alias or a tuple of aliases (outer first), as in a plain layout call.
        groups: the number of groups (an int >= 1; 1 is a plain split).

    Returns:
        A `Strided` argument for `Layout.__call__`.

    Raises:
        LayoutTypeError: `axes` is not an alias or a tuple of aliases, `groups` not an int.
        ValueError: `groups` < 1, no alias, or ``"None"`` among the aliases.

    Example:
        >>> layout = Layout((2, 4), ("dp", "mp"))
        >>> w = layout(strided("mp", 3), "None")   # c_attn.weight [3C, C]
        >>> str(w)
        '(strided(mp, 3), None) on DeviceMatrix(dp=2, mp=4)'
    """
    names = (axes,) if isinstance(axes, str) else axes
    if not isinstance(names, tuple | list) or any(not isinstance(a, str) for a in names):
        raise LayoutTypeError(f"strided: axes must be an alias or a tuple of aliases, got {axes!r}")
    if not names or NONE in names:
        raise ValueError(
            f"strided({axes!r}, {groups!r}): give the alias(es) that split each group; "
            f"'None' cannot be strided"
        )
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise LayoutTypeError(f"strided: groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"strided({axes!r}, {groups}): groups must be >= 1")
    return Strided(tuple(names), groups)


DimSpec: TypeAlias = str | tuple[str, ...] | Strided | None
"""One argument of a layout call: an alias, ``"None"`` (or ``None``), a tuple of aliases, or a
`strided` dim."""

TensorMapEntry: TypeAlias = int | tuple[int, ...]


class LayoutTypeError(TypeError, ValueError):
    """A layout or strategy argument of the wrong type (catchable as TypeError or ValueError)."""


def index_tuple(value: object) -> tuple[int, ...] | None:
    """`value` (a list or tuple of integers: ints, NumPy integers, anything with
    ``__index__``; not bools) as a tuple of Python ints, else None."""
    if not isinstance(value, tuple | list):
        return None
    out = []
    for v in value:
        if isinstance(v, bool):
            return None
        try:
            out.append(operator.index(v))
        except TypeError:
            return None
    return tuple(out)


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    """`value` as a tuple of ints (`index_tuple`), else LayoutTypeError."""
    ints = index_tuple(value)
    if ints is None:
        raise LayoutTypeError(f"{what} must be a tuple of ints, got {value!r}")
    return ints


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
            raise ValueError(
                f"alias 'interleaved_parallel' in {names} is not supported by shardwise (MindSpore "
                "runs an op as several copies within one device along it, to overlap their "
                "communication; the values are those of the layout without it): drop it and "
                "its size from device_matrix and alias_name, and from the layouts that use it"
            )
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
                split), a tuple of aliases (split by all of them, the first outer) or
                ``strided(aliases, groups)`` (cut into equal groups, each split by them).

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
        groups = tuple(s.groups if isinstance(s, Strided) else 1 for s in tensor_map)
        seen: dict[int, int] = {}
        for d, axes in enumerate(dims):
            for a in axes:
                if a in seen:
                    where = f"twice in dim {d}" if seen[a] == d else f"by dims {seen[a]} and {d}"
                    raise ValueError(
                        f"layout{_call_str(tensor_map)}: alias {self.matrix.names[a]!r} is used "
                        f"{where}; each alias may split a tensor only once"
                    )
                seen[a] = d
        return TensorLayout(self.matrix, dims, groups)

    def _parse_dim(self, spec: object, dim: int, call: tuple[object, ...]) -> tuple[int, ...]:
        """The axes that split tensor dim `dim` according to `spec` (outer first)."""
        where = f"layout{_call_str(call)}, dim {dim}"
        if isinstance(spec, Strided):
            spec = spec.axes
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
        """The inverse of `to_dict` (``rank_list`` may be missing).

        Raises:
            ValueError: `data` is not a dict or lacks ``device_matrix`` / ``alias_name`` (the
                key named), or `Layout` refuses the values.
        """
        for key in ("device_matrix", "alias_name"):
            _require(data, key)
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
    become lists) and, for a strided layout, ``"groups"`` (one count per dim)."""
    tmap = [list(e) if isinstance(e, tuple) else e for e in tensor_map(layout)]
    out = {**Layout.of(layout.matrix).to_dict(), "tensor_map": tmap}
    if layout.groups:
        out["groups"] = list(layout.groups)
    return out


def tensor_layout_from_dict(data: Mapping[str, Any]) -> TensorLayout:
    """The inverse of `tensor_layout_to_dict`.

    Raises:
        ValueError: a missing key (``device_matrix``, ``alias_name``, ``tensor_map``), a
            tensor_map entry that is not ``-1``, an axis index of the device matrix or a
            non-empty list of them, or ``groups`` that are not one int >= 1 per tensor_map
            entry (LayoutTypeError, also a ValueError, for a value of the wrong type).
    """
    layout = Layout.from_dict(data)
    _require(data, "tensor_map")
    last = len(layout.device_matrix) - 1
    entries = data["tensor_map"]
    if not isinstance(entries, list | tuple):
        raise LayoutTypeError(
            f"tensor_map must be a list (one entry per tensor dim), got {entries!r}"
        )
    dims: list[tuple[int, ...]] = []
    for entry in entries:
        idx = [entry] if isinstance(entry, int) else entry
        if idx == [-1]:
            dims.append(())
            continue
        if (
            not isinstance(idx, list | tuple)
            or not idx
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= last for i in idx)
        ):
            raise ValueError(
                f"tensor_map entry {entry!r} is not in 0..{last} or -1: give -1 (not split), "
                f"an axis index in 0..{last} (counted from the right) or a non-empty list of them"
            )
        dims.append(tuple(last - i for i in idx))
    _check_repeats(entries, dims, layout.alias_name)
    groups = data.get("groups") or ()
    if not isinstance(groups, list | tuple) or any(
        isinstance(g, bool) or not isinstance(g, int) for g in groups
    ):
        raise LayoutTypeError(
            f"groups {groups!r}: give one int >= 1 per tensor_map entry ({len(dims)}), "
            f"e.g. {[3] + [1] * (len(dims) - 1)}"
        )
    if groups and (len(groups) != len(dims) or any(g < 1 for g in groups)):
        raise ValueError(
            f"groups {list(groups)}: give one int >= 1 per tensor_map entry ({len(dims)}), "
            f"e.g. {[3] + [1] * (len(dims) - 1)}"
        )
    return TensorLayout(layout.matrix, tuple(dims), tuple(groups))


def _check_repeats(
    entries: Sequence[object], dims: Sequence[tuple[int, ...]], names: Sequence[str]
) -> None:
    """A ValueError naming the tensor_map entries (dims) that give one axis index twice."""
    seen: dict[int, int] = {}
    for d, axes in enumerate(dims):
        for a in axes:
            if a in seen:
                first = seen[a]
                which = (
                    f"entry {d} ({entries[d]!r}) twice"
                    if first == d
                    else f"entries {first} ({entries[first]!r}) and {d} ({entries[d]!r})"
                )
                raise ValueError(
                    f"tensor_map {list(entries)!r}: axis index {len(names) - 1 - a} "
                    f"({names[a]!r}) is given by {which}; an axis splits at most one dim, once: "
                    f"give -1 (not split) or another axis index for one of them"
                )
            seen[a] = d


def _require(data: object, key: str) -> None:
    """Raise a ValueError naming `key` if `data` is not a dict holding it."""
    if not isinstance(data, Mapping):
        raise LayoutTypeError(
            f"a layout dict (device_matrix, alias_name, tensor_map) is expected, got {data!r}"
        )
    if key not in data:
        raise ValueError(
            f"layout dict {dict(data)!r} has no {key!r} key; give device_matrix (axis sizes), "
            f"alias_name (one name per axis) and, for a tensor, tensor_map (one entry per dim)"
        )
