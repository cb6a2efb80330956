"""One global mesh for many device matrices: refinement.

Every primitive builds its own device matrix (MatMul ``((2, 4), (4, 1))`` -> ``[2, 4, 1]``, ReLU
``((4, 1),)`` -> ``[4, 1, 2]``), but DTensor redistributes only between placements on the same
`DeviceMesh`. A finer matrix whose consecutive axes multiply to each coarse axis holds the same
ranks in the same row-major order (rank ``4*a + b`` on ``[2, 4]`` is ``4*a + 2*b1 + b2`` on
``[2, 2, 2]``), so a layout on the coarse matrix is the same layout on the fine one with every
coarse axis replaced by its run of fine axes, slower (outer) first.

- `common_refinement`: the coarsest shape that refines every given shape (or a ValueError);
  `untiled_block`: why there is none.
- `axis_runs`: which fine axes make up each coarse axis.
- `refine`: a `TensorLayout` moved onto the finer matrix (every rank keeps the same slice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardwise.layout._core import DeviceMatrix, TensorLayout


def _prefix_products(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for size in shape:
        acc *= size
        out.append(acc)
    return out


def common_refinement(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The coarsest device-matrix shape that refines every shape in `shapes`.

    Args:
        shapes: device-matrix shapes of the same size, slowest axis first.

    Returns:
        A shape (no size-1 axes; ``(1,)`` for a 1-device job) such that every axis of every input
        shape is a product of consecutive axes of it.

    Raises:
        ValueError: sizes differ, or the shapes cut the ranks incompatibly (e.g. ``(3, 4)`` and
            ``(2, 6)``: 3 ranks per row vs 2).

    Example:
        >>> common_refinement([(2, 4, 1), (4, 1, 2), (1, 8, 1), (8, 1)])
        (2, 2, 2)
    """
    sizes = {math.prod(s) for s in shapes}
    if len(sizes) != 1:
        raise ValueError(f"device matrices {list(shapes)} hold different numbers of devices")
    untiled = untiled_block(shapes)
    if untiled is not None:
        n, (few, many) = sizes.pop(), untiled  # (numbers of blocks: sizes n // them)
        raise ValueError(
            f"device matrices {[tuple(s) for s in shapes]} have no common refinement: a "
            f"block of {n // many} consecutive ranks does not tile a block of {n // few}"
        )
    cuts = sorted({p for s in shapes for p in _prefix_products(s)})
    out, prev = [], 1
    for cut in cuts:
        if cut > prev:
            out.append(cut // prev)
        prev = cut
    return tuple(out) or (1,)


def untiled_block(shapes: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """Why `shapes` have no common refinement, or None: the first pair (smaller, larger) of
    their prefix products (each axis cuts the ranks into that many blocks of consecutive ranks,
    with the axes before it) where the smaller does not divide the larger.

    Example:
        >>> untiled_block([(3, 4), (2, 6)])  # 2 blocks of 6 ranks, 3 blocks of 4
        (2, 3)
    """
    prev = 1
    for cut in sorted({p for s in shapes for p in _prefix_products(s)}):
        if cut % prev:
            return prev, cut
        prev = cut
    return None


def axis_runs(coarse: Sequence[int], fine: Sequence[int]) -> list[tuple[int, ...]]:
    """For each axis of `coarse`, the consecutive axes of `fine` that multiply to it.

    Size-1 axes of `coarse` get an empty run; size-1 axes of `fine` are left out of every run.

    Raises:
        ValueError: `fine` does not refine `coarse`.

    Example:
        >>> axis_runs((2, 4, 1), (2, 2, 2))
        [(0,), (1, 2), ()]
    """
    fine_cuts = _prefix_products(fine)
    runs: list[tuple[int, ...]] = []
    start = 0
    for cut in _prefix_products(coarse):
        stop = start
        while stop < len(fine) and fine_cuts[stop] <= cut:
            stop += 1
        if (fine_cuts[stop - 1] if stop else 1) != cut:
            raise ValueError(f"device matrix {tuple(fine)} does not refine {tuple(coarse)}")
        runs.append(tuple(a for a in range(start, stop) if fine[a] > 1))
        start = stop
    return runs


def refine(layout: TensorLayout, fine: DeviceMatrix) -> TensorLayout:
    """`layout` expressed on the finer matrix `fine` (same ranks, same slices).

    Args:
        layout: a layout on a coarser matrix with the same rank list.
        fine: a refinement of ``layout.matrix`` (see `common_refinement`).

    Returns:
        The layout on `fine`: each coarse axis replaced by its run of fine axes, outer first
        (strided groups kept).

    Raises:
        ValueError: different rank lists, or `fine` does not refine the layout's matrix.

    Example:
        >>> coarse = DeviceMatrix((2, 4, 1), ("d0", "d1", "d2"))
        >>> fine = DeviceMatrix((2, 2, 2), ("m0", "m1", "m2"))
        >>> refine(TensorLayout(coarse, ((0,), (1,))), fine).dims
        ((0,), (1, 2))
    """
    if layout.matrix.rank_list != fine.rank_list:
        raise ValueError(f"{fine} and {layout.matrix} order the ranks differently")
    runs = axis_runs(layout.matrix.shape, fine.shape)
    dims = tuple(tuple(f for a in axes for f in runs[a]) for axes in layout.dims)
    return TensorLayout(fine, dims, layout.groups)
