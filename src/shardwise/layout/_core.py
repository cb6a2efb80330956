"""The core of the layout algebra: a device matrix with named axes, and a tensor's layout on it.

`DeviceMatrix` arranges ranks row-major (the first axis is the slowest, the last the fastest):
`coord` / `rank` convert between a rank and its coordinate, `group_along` lists the ranks that
differ only along some axes (the group a collective over those axes runs on).

`TensorLayout` says, for each tensor dim, which device axes split it, outer first (MindSpore's
tuple alias order: for ``("sp", "dp")`` the block index is ``sp * |dp| + dp``). Axes that split no
dim hold replicas. `block_index`, `local_shape` and `local_slice` give the part of a global
tensor each rank holds; `check` validates a layout against a global shape.

A dim may also be *strided* (`TensorLayout.groups`): cut into ``g`` equal groups first, each
group split over the dim's axes, and each rank holding its block of every group, in group order
(``sw.strided("mp", 3)`` on a fused q/k/v projection's ``3C`` outputs: each rank holds its heads
of q, of k and of v). Its block is then not one contiguous range: `local_index` gives it as an
index ``tensor[index]`` accepts, `local_ranges` as ranges.

Everything here is pure: no process group, no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceMatrix:
    """Ranks arranged in a named, row-major grid.

    Attributes:
        shape: size of every axis, slowest first.
        names: one alias per axis.
        rank_list: the global rank at each position (row-major); default ``0 .. size - 1``.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> m.coord(5), m.rank((1, 0, 1))
        ((1, 0, 1), 5)
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    rank_list: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.shape or any(not isinstance(s, int) or s < 1 for s in self.shape):
            raise ValueError(f"device matrix {self.shape}: every axis size must be an int >= 1")
        if len(self.names) != len(self.shape):
            raise ValueError(
                f"device matrix {self.shape} has {len(self.shape)} axes but "
                f"{len(self.names)} alias names {self.names}"
            )
        if len(set(self.names)) != len(self.names) or "None" in self.names:
            raise ValueError(f"alias names {self.names} must be distinct and not 'None'")
        if not self.rank_list:
            object.__setattr__(self, "rank_list", tuple(range(self.size)))
        ranks = self.rank_list
        if len(ranks) != self.size or len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(
                f"rank_list {list(ranks)} must hold {self.size} distinct ranks >= 0 "
                f"(the product of the device matrix {self.shape})"
            )

    @property
    def size(self) -> int:
        """Number of devices (the product of the shape)."""
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        """Index of the axis called `name`.

        Raises:
            ValueError: unknown alias (the message lists the known ones).
        """
        if name not in self.names:
            raise ValueError(f"unknown alias {name!r}; this device matrix has {list(self.names)}")
        return self.names.index(name)

    def coord(self, rank: int) -> tuple[int, ...]:
        """The coordinate of global `rank` (first axis slowest)."""
        if rank not in self.rank_list:
            raise ValueError(f"rank {rank} is not in this device matrix {self}")
        pos = self.rank_list.index(rank)
        out = []
        for size in reversed(self.shape):
            out.append(pos % size)
            pos //= size
        return tuple(reversed(out))

    def rank(self, coord: Sequence[int]) -> int:
        """The global rank at `coord` (one index per axis)."""
        if len(coord) != len(self.shape):
            raise ValueError(
                f"coordinate {tuple(coord)} has {len(coord)} entries but {self} has "
                f"{len(self.shape)} axes; give one index per axis"
            )
        pos = 0
        for c, size in zip(coord, self.shape, strict=True):
            if not 0 <= c < size:
                raise ValueError(f"coordinate {tuple(coord)} is outside {self.shape}")
            pos = pos * size + c
        return self.rank_list[pos]

    def group_along(self, rank: int, axes: Sequence[int]) -> tuple[int, ...]:
        """The ranks that share `rank`'s coordinate except along `axes`, ordered by their
        coordinate along `axes` (the first axis outer): the group of a collective over `axes`.
        """
        base = list(self.coord(rank))
        out = []
        for k in range(math.prod(self.shape[a] for a in axes)):
            c = list(base)
            for a in reversed(axes):
                c[a] = k % self.shape[a]
                k //= self.shape[a]
            out.append(self.rank(c))
        return tuple(out)

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))
        default = self.rank_list == tuple(range(self.size))
        return f"DeviceMatrix({axes}{'' if default else f', ranks={list(self.rank_list)}'})"


@dataclass(frozen=True)
class TensorLayout:
    """Which device axes split each dim of a tensor.

    Attributes:
        matrix: the device matrix.
        dims: for each tensor dim, the indices of the axes splitting it, outer first; ``()``
            means not split.
        groups: for each tensor dim, into how many equal groups it is cut before its axes
            split each group (a strided dim; DTensor's ``_StridedShard``); ``()`` means 1 for
            every dim. Kept only for dims split into more than one part (else normalized to 1),
            and ``()`` when every dim has 1, so a plain layout equals one built without it.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> x = TensorLayout(m, ((2,), (1, 0)))          # layout("mp", ("sp", "dp"))
        >>> str(x), x.local_shape((8, 16))
        ('(mp, (sp, dp)) on DeviceMatrix(dp=2, sp=2, mp=2)', (4, 4))
        >>> qkv = TensorLayout(m, ((2,), ()), groups=(3, 1))  # layout(strided("mp", 3), None)
        >>> qkv.local_index(1, (12, 4))                       # rank 1: mp = 1
        ([2, 3, 6, 7, 10, 11], slice(0, 4, None))
    """

    matrix: DeviceMatrix
    dims: tuple[tuple[int, ...], ...]
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.dims, tuple | list) or any(
            not isinstance(axes, tuple | list)
            or any(isinstance(a, bool) or not isinstance(a, int) for a in axes)
            for axes in self.dims
        ):
            raise TypeError(
                f"TensorLayout dims {self.dims!r}: give one tuple of axis indices per tensor dim, "
                f"outer first (() for a dim that is not split), e.g. ((0,), ()) for "
                f"(dp, None)"
            )
        object.__setattr__(self, "dims", tuple(tuple(axes) for axes in self.dims))
        used = [a for axes in self.dims for a in axes]
        bad = [a for a in used if not 0 <= a < len(self.matrix.shape)]
        if bad:
            raise ValueError(f"axes {bad} are not axes of {self.matrix}")
        if len(set(used)) != len(used):
            raise ValueError(self._repeated_axis())
        if not self.groups:
            return
        if len(self.groups) != len(self.dims) or any(
            isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.groups
        ):
            raise ValueError(
                f"groups {self.groups}: give one group count >= 1 per tensor dim "
                f"({len(self.dims)} dims)"
            )
        kept = tuple(g if self.split_count(d) > 1 else 1 for d, g in enumerate(self.groups))
        object.__setattr__(self, "groups", kept if any(g > 1 for g in kept) else ())

    def _repeated_axis(self) -> str:
        """Why `dims` is refused: the first device axis that splits two dims, or one twice."""
        where: dict[int, list[int]] = {}
        for d, axes in enumerate(self.dims):
            for a in axes:
                where.setdefault(a, []).append(d)
        a, ds = next((a, ds) for a, ds in where.items() if len(ds) > 1)
        splits = f"dim {ds[0]} twice" if ds[0] == ds[1] else f"dims {ds[0]} and {ds[1]}"
        return (
            f"device axis {self.matrix.names[a]!r} splits {splits} (dims "
            f"{[tuple(self.matrix.names[x] for x in axes) for axes in self.dims]}); a device "
            f"axis splits at most one dim, once: use another axis or 'None' for one of them"
        )

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def used_axes(self) -> tuple[int, ...]:
        """Axes that split some dim."""
        return tuple(sorted(a for axes in self.dims for a in axes))

    def is_split(self) -> bool:
        """Whether some dim is cut into blocks (an axis of size > 1 splits it)."""
        return any(self.matrix.shape[a] > 1 for a in self.used_axes())

    def replicated_axes(self) -> tuple[int, ...]:
        """Axes along which the tensor is replicated (they split no dim)."""
        used = set(self.used_axes())
        return tuple(a for a in range(len(self.matrix.shape)) if a not in used)

    def split_count(self, dim: int) -> int:
        """Into how many blocks `dim` is cut."""
        return math.prod(self.matrix.shape[a] for a in self.dims[dim])

    def groups_of(self, dim: int) -> int:
        """Into how many strided groups `dim` is cut (1: a plain split, or not split)."""
        return self.groups[dim] if self.groups else 1

    @property
    def strided(self) -> bool:
        """Whether some dim is strided (its block is not one contiguous range)."""
        return bool(self.groups)

    def plain(self) -> TensorLayout:
        """The same axes on every dim, without strided groups."""
        return TensorLayout(self.matrix, self.dims) if self.groups else self

    def block_index(self, rank: int, dim: int) -> int:
        """Which block of `dim` global `rank` holds (outer axes first)."""
        coord = self.matrix.coord(rank)
        index = 0
        for a in self.dims[dim]:
            index = index * self.matrix.shape[a] + coord[a]
        return index

    def check(self, shape: Sequence[int], who: str = "tensor") -> None:
        """Raise a ValueError naming `who`, the dim and the axes if the layout cannot hold a
        tensor of global `shape`."""
        if len(shape) != self.ndim:
            raise ValueError(
                f"{who}: layout {self} has {self.ndim} dims but the tensor has shape {list(shape)}"
            )
        for d, size in enumerate(shape):
            # an int or a symbolic one (torch.SymInt has __index__; a float has not)
            if (
                isinstance(size, bool)
                or not hasattr(size, "__index__")
                or (isinstance(size, int) and size < 0)
            ):
                raise ValueError(
                    f"{who}: shape {list(shape)}: dim {d} has size {size!r}; a global shape "
                    f"holds ints >= 0"
                )
            parts = self.split_count(d)
            names = tuple(self.matrix.names[a] for a in self.dims[d])
            axes = "*".join(names)
            g = self.groups_of(d)
            if g > 1 and size % (g * parts):
                # the `strided` call to write: an alias, or a tuple of aliases (outer first)
                arg = repr(names[0]) if len(names) == 1 else repr(names)
                which = "axis" if len(names) == 1 else "axes"
                raise ValueError(
                    f"{who}: dim {d} of size {size} cannot be cut into {g} strided groups each "
                    f"split into {parts} parts ({which} {axes}): {g} x {parts} = {g * parts} "
                    f"does not divide {size}; use a group count and a split whose product divides "
                    f"{size} (strided({arg}, k) with k x {parts} dividing {size}), or a "
                    f"plain split"
                )
            if size % parts:
                raise ValueError(
                    f"{who}: dim {d} of size {size} cannot be split into {parts} parts "
                    f"(axes {axes}); use a split that divides {size}"
                )

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of each rank's block of a tensor of global `shape`."""
        self.check(shape)
        return tuple(size // self.split_count(d) for d, size in enumerate(shape))

    def local_slice(self, rank: int, shape: Sequence[int]) -> tuple[slice, ...]:
        """The slices of a global tensor of `shape` that global `rank` holds.

        Raises:
            ValueError: a strided layout (its block is several ranges: use `local_index`).
        """
        if self.groups:
            raise ValueError(
                f"layout {self} is strided: a rank's block is not one slice; use local_index "
                f"(an index tensor[index] accepts) or local_ranges"
            )
        local = self.local_shape(shape)
        return tuple(
            slice(self.block_index(rank, d) * n, (self.block_index(rank, d) + 1) * n)
            for d, n in enumerate(local)
        )

    def local_ranges(self, rank: int, shape: Sequence[int]) -> tuple[tuple[range, ...], ...]:
        """Per dim, the global index ranges global `rank` holds, in the order its block holds
        them: one range for a plain dim, one per group for a strided dim."""
        local = self.local_shape(shape)
        out = []
        for d, n in enumerate(local):
            g = self.groups_of(d)
            step, start = shape[d] // g, self.block_index(rank, d) * (n // g)
            out.append(tuple(range(i * step + start, i * step + start + n // g) for i in range(g)))
        return tuple(out)

    def local_index(self, rank: int, shape: Sequence[int]) -> tuple[slice | list[Any], ...]:
        """The index of global `rank`'s block in a global tensor of `shape`:
        ``global[layout.local_index(rank, shape)]`` is the block.

        A plain layout gives `local_slice`; a strided dim gives the list of its global indices
        (with several strided dims, every dim becomes a nested list shaped to broadcast, so
        that advanced indexing takes their outer product).
        """
        if not self.groups:
            return self.local_slice(rank, shape)
        ranges = self.local_ranges(rank, shape)
        flat = [[i for r in rs for i in r] for rs in ranges]
        strided = [d for d in range(self.ndim) if self.groups_of(d) > 1]
        if len(strided) == 1:
            return tuple(
                flat[d] if d in strided else slice(rs[0].start, rs[0].stop)
                for d, rs in enumerate(ranges)
            )
        out: list[slice | list[Any]] = []
        for d, idx in enumerate(flat):  # shape [n_d, 1, ..., 1]: broadcasts to the block
            nested: list[Any] = list(idx)
            for _ in range(self.ndim - 1 - d):
                nested = [[x] for x in nested]
            out.append(nested)
        return tuple(out)

    def __str__(self) -> str:
        def one(d: int, axes: tuple[int, ...]) -> str:
            names = [self.matrix.names[a] for a in axes]
            if not names:
                return "None"
            text = names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
            g = self.groups_of(d)
            return f"strided({text}, {g})" if g > 1 else text

        return f"({', '.join(one(d, a) for d, a in enumerate(self.dims))}) on {self.matrix}"
