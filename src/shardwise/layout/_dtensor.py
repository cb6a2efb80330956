"""Layouts as DTensor placements on a `DeviceMesh` of the same shape.

Mesh dim i is device-matrix axis i (same size, named by its alias). `to_placements` gives each
mesh dim ``Replicate()`` (the axis splits nothing, or has size 1), ``Shard(d)`` or
``_StridedShard(d, split_factor=f)``; `from_placements` is its inverse; `device_mesh_for` builds
the mesh (every rank of the world must call it, like any process-group creation).

Why `_StridedShard`: DTensor applies placements in mesh-dim order, each to the local piece the
previous ones left, so ``Shard(d)`` on several mesh dims makes the lowest mesh dim the outer block
index. MindSpore's tuple order is free: ``("sp", "dp")`` makes sp outer although dp is the lower
mesh dim. The rule (`split_factor`): for a mesh dim m splitting tensor dim d, the split factor is
the product of the sizes of the axes that split d, come before m in d's tuple (outer) and after m
in mesh order (not yet applied). Factor 1 is a plain ``Shard(d)``.

Derivation: before mesh dim m is applied, the local piece is the blocks whose digits on the
already-applied axes match this rank, in global order, i.e. an array indexed by the remaining axes
of d in tuple order. Viewed as ``[outer, |m|, inner]`` (outer = remaining axes before m in the
tuple), selecting coordinate c in the middle is exactly ``_StridedShard(d, split_factor=outer)``:
cut into `outer` pieces, cut each into |m| chunks, keep chunk c of every piece.

A strided dim (`TensorLayout.groups`: g groups, each split over the dim's axes) is the same array
with one more outermost index, the group, which no mesh dim selects: every mesh dim's factor is
multiplied by g (``layout(strided("mp", 3), "None")`` on one axis: ``_StridedShard(0,
split_factor=3)``). `from_placements` finds g as the factor of the dim's outermost axis.
"""

from __future__ import annotations

import datetime
import itertools
import math

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise._torch.dtensor import StridedShard
from shardwise.communication.mesh import device_mesh
from shardwise.layout._core import DeviceMatrix, TensorLayout


def split_factor(layout: TensorLayout, axis: int) -> int:
    """The `_StridedShard` split factor of mesh dim `axis` (1 = plain ``Shard``).

    Args:
        layout: the tensor layout.
        axis: a device-matrix axis that splits some dim of `layout`.

    Returns:
        The product of the sizes of the axes that split the same dim, are outer to `axis` in its
        tuple and come after `axis` in mesh order (size-1 axes count as 1), times the dim's
        strided group count.

    Example:
        >>> m = DeviceMatrix((2, 2, 2), ("dp", "sp", "mp"))
        >>> split_factor(TensorLayout(m, ((2,), (1, 0))), 0)    # ("sp", "dp"): dp under sp
        2
    """
    for d, axes in enumerate(layout.dims):
        if axis in axes:
            outer = axes[: axes.index(axis)]
            inner = math.prod(layout.matrix.shape[a] for a in outer if a > axis)
            return layout.groups_of(d) * inner
    raise ValueError(f"axis {axis} splits no dim of {layout}")


def to_placements(layout: TensorLayout) -> tuple[Placement, ...]:
    """The DTensor placements of `layout` on `device_mesh_for(layout.matrix)`.

    Args:
        layout: a tensor layout.

    Returns:
        One placement per mesh dim: ``Replicate()``, ``Shard(d)`` or
        ``_StridedShard(d, split_factor=f)`` (see `split_factor`).

    Example:
        >>> from shardwise.layout import Layout
        >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        >>> to_placements(layout("mp", ("sp", "dp")))
        (_StridedShard(dim=1, sf=2), Shard(dim=1), Shard(dim=0))
    """
    out: list[Placement] = []
    for axis, size in enumerate(layout.matrix.shape):
        dim = next((d for d, axes in enumerate(layout.dims) if axis in axes), None)
        if dim is None or size == 1:
            out.append(Replicate())
            continue
        factor = split_factor(layout, axis)
        out.append(Shard(dim) if factor == 1 else StridedShard(dim, split_factor=factor))
    return tuple(out)


def from_placements(
    matrix: DeviceMatrix, placements: tuple[Placement, ...], ndim: int
) -> TensorLayout:
    """The `TensorLayout` whose `to_placements` is `placements` (the inverse mapping).

    Args:
        matrix: the device matrix of the mesh.
        placements: one per mesh dim; only Replicate, Shard and _StridedShard.
        ndim: the tensor's number of dims.

    Returns:
        The layout; size-1 mesh dims never appear in it. ``_StridedShard(d, split_factor=1)``
        (DTensor's view rule merging a dim whose outer part is split whole) is read as
        ``Shard(d)``: one piece cut into chunks is the same split. A negative dim counts from
        the end, as in DTensor (``Shard(-1)`` is ``Shard(ndim - 1)``).

    Raises:
        ValueError: a Partial or other placement, a dim outside ``-ndim..ndim - 1``, or a
            _StridedShard combination that no tuple order and group count produces.

    Example:
        >>> m = DeviceMatrix((2, 2), ("dp", "mp"))
        >>> from_placements(m, (_StridedShard(0, split_factor=2), Shard(0)), 1).dims
        ((1, 0),)
    """
    if len(placements) != len(matrix.shape):
        raise ValueError(f"{len(placements)} placements for {matrix}")
    placements = tuple(_normalized(p, axis, ndim) for axis, p in enumerate(placements))
    by_dim: list[list[int]] = [[] for _ in range(ndim)]
    for axis, p in enumerate(placements):
        if isinstance(p, Shard | StridedShard):
            if matrix.shape[axis] > 1:
                by_dim[p.dim].append(axis)
        elif not isinstance(p, Replicate):
            raise ValueError(f"mesh dim {axis}: {p} has no layout (only Replicate / Shard)")
    want = tuple(Replicate() if matrix.shape[a] == 1 else p for a, p in enumerate(placements))
    choices = [list(itertools.permutations(axes)) for axes in by_dim]
    # a strided dim's group count is the factor of its outermost axis (`split_factor`)
    factors = [
        sorted({1} | {getattr(placements[a], "split_factor", 1) for a in axes}) for axes in by_dim
    ]
    for dims in itertools.product(*choices):
        for groups in itertools.product(*factors):
            candidate = TensorLayout(matrix, tuple(dims), tuple(groups))
            if to_placements(candidate) == want:
                return candidate
    raise ValueError(f"placements {placements} match no axis order on {matrix}")


def _normalized(p: Placement, axis: int, ndim: int) -> Placement:
    """`p` with a negative tensor dim counted from the end (``Shard(-1)`` is ``Shard(ndim - 1)``)
    and ``_StridedShard(d, split_factor=1)`` as ``Shard(d)``; a dim outside the tensor raises."""
    if not isinstance(p, Shard | StridedShard):
        return p
    if not -ndim <= p.dim < ndim:
        raise ValueError(
            f"mesh dim {axis}: {p} names tensor dim {p.dim}, but the tensor has {ndim} dims; "
            f"give a dim in {-ndim}..{ndim - 1}"
        )
    dim = p.dim % ndim
    if isinstance(p, StridedShard) and p.split_factor != 1:
        return StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


def device_mesh_for(
    matrix: DeviceMatrix,
    device_type: str = "cpu",
    *,
    timeout: datetime.timedelta | None = None,
) -> DeviceMesh:
    """A `DeviceMesh` with the matrix's shape, rank list and alias names.

    Every rank of the default process group must call it (it creates one group per mesh dim).

    Args:
        matrix: the device matrix.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        timeout: for the mesh-dim groups; default ``$SHARDWISE_COMM_TIMEOUT`` seconds (300),
            never torch's 30 minutes.

    Returns:
        The mesh; ``to_placements(layout)`` gives placements on it.

    Example:
        >>> mesh = device_mesh_for(Layout((2, 2, 2), ("dp", "sp", "mp")).matrix)  # 8 ranks
        >>> mesh.mesh_dim_names
        ('dp', 'sp', 'mp')
    """
    return device_mesh(matrix.rank_list, matrix.shape, matrix.names, device_type, timeout)
