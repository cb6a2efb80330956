"""Helpers for primitives' sharding rules (pure, no tensors).

- `elementwise_axes`: the rule of elementwise primitives (the strategy itself is the device
  matrix; inputs right-aligned; broadcast dims never split).
- `data_parallel_strategy`: the default strategy of a primitive without one (dim 0 of the chosen
  inputs split over every device).
- `iter_rank_slices`: every rank with the slice of a global tensor it holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shardwise.layout._core import TensorLayout


def elementwise_axes(shapes: Sequence[Sequence[int]]) -> list[list[int | None]]:
    """The rule of elementwise primitives: the strategy itself is the device matrix.

    Inputs are aligned on the right (NumPy broadcasting); axis k is output dim k. A dim of size 1
    that is broadcast against a larger size maps to None (it cannot be split).

    Args:
        shapes: the inputs' shapes (only their lengths matter when nothing broadcasts).

    Returns:
        Per input, per dim, the axis index or None.

    Example:
        >>> elementwise_axes([[32, 512], [512]])
        [[0, 1], [1]]
        >>> elementwise_axes([[32, 512], [1, 512]])
        [[0, 1], [None, 1]]
    """
    out_rank = max((len(s) for s in shapes), default=0)
    out_shape = [1] * out_rank
    for shape in shapes:
        for d, size in enumerate(shape):
            k = out_rank - len(shape) + d
            out_shape[k] = max(out_shape[k], size)
    result: list[list[int | None]] = []
    for shape in shapes:
        offset = out_rank - len(shape)
        result.append(
            [
                None if size == 1 and out_shape[offset + d] > 1 else offset + d
                for d, size in enumerate(shape)
            ]
        )
    return result


def data_parallel_strategy(
    ranks: Sequence[int], device_num: int, split: Sequence[bool] | None = None
) -> tuple[tuple[int, ...], ...]:
    """The default strategy of a primitive without one (MindSpore's batch-parallel strategy):
    dim 0 of every input in `split` is cut into `device_num` parts, every other dim is whole.

    Args:
        ranks: the number of dims of each input.
        device_num: devices in the job.
        split: which inputs carry the batch dim (default: all inputs with at least one dim).
            MatMul passes ``[True, False]``: x is split, the weight is replicated.

    Returns:
        An int strategy, e.g. ``((8, 1), (1, 1))``.

    Example:
        >>> data_parallel_strategy([2, 2], 8, [True, False])
        ((8, 1), (1, 1))
    """
    flags = list(split) if split is not None else [r > 0 for r in ranks]
    return tuple(
        tuple(device_num if d == 0 and flag else 1 for d in range(r))
        for r, flag in zip(ranks, flags, strict=True)
    )


def iter_rank_slices(
    layout: TensorLayout, shape: Sequence[int]
) -> Iterator[tuple[int, tuple[slice, ...]]]:
    """Every rank of the layout's matrix with the slice of a global `shape` it holds.

    Example:
        >>> x = DeviceMatrix((8,), ("dp",))
        >>> next(iter_rank_slices(TensorLayout(x, ((0,), ())), (32, 4)))
        (0, (slice(0, 4, None), slice(0, 4, None)))
    """
    for rank in layout.matrix.rank_list:
        yield rank, layout.local_slice(rank, shape)
