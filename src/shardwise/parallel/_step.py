"""The inputs of a wrapped call: dataset strategies.

(Finding a train step's network and optimizers is `_discover`.) MindSpore's convention:
``"data_parallel"``: each rank passes its own rows of the global batch (the ranks' rows in rank
order); ``"full_batch"``: each rank passes the whole global batch; per-input entries: each rank
passes its block of the entry's layout.

- `check_dataset_strategy`: a dataset strategy's types (a name, or one int tuple / Layout call
  per input, never mixed; a Layout without a ``rank_list``).
- `input_layout`: the layout of input i under per-input strategies (each entry on its own
  device matrix, the repeat factor appended on the right as for a primitive).
"""

from __future__ import annotations

from shardwise.layout import LayoutTypeError, TensorLayout, resolve_strategy
from shardwise.ops import normalize_strategy

DATASET_STRATEGIES = ("data_parallel", "full_batch")
DatasetStrategy = str | tuple[tuple[int, ...] | TensorLayout, ...]
"""A dataset strategy name, or one entry (split counts or a Layout call) per input."""

_WHO = "dataset_strategy"


def check_dataset_strategy(strategy: object) -> DatasetStrategy:
    """`strategy` checked: ``"data_parallel"``, ``"full_batch"`` or per-input entries.

    Raises:
        ValueError: an unknown name; mixed int tuples and Layouts; a malformed entry; a
            Layout with a ``rank_list``.
        LayoutTypeError: None (a TypeError that is also a ValueError), naming the valid ones.
    """
    if strategy is None:
        raise LayoutTypeError(
            f"{_WHO}: None is no dataset strategy; pass {DATASET_STRATEGIES[0]!r} (the default: "
            f"each rank passes its own rows), {DATASET_STRATEGIES[1]!r} or one tuple / Layout "
            f"call per input, e.g. ((8, 1), (8,))"
        )
    if isinstance(strategy, str):
        if strategy not in DATASET_STRATEGIES:
            raise ValueError(
                f"{_WHO}: {strategy!r}; valid: {' | '.join(map(repr, DATASET_STRATEGIES))} or "
                f"one tuple / Layout call per input, e.g. ((8, 1), (8,))"
            )
        return strategy
    out = normalize_strategy(strategy, "strategy", _WHO)
    assert out is not None
    for i, entry in enumerate(out):
        if isinstance(entry, TensorLayout):
            _check_rank_order(i, entry)
    return out


def _check_rank_order(index: int, entry: TensorLayout) -> None:
    """Raise ValueError when entry `index`'s Layout orders the devices by a ``rank_list``:
    each rank's block of an input is its block in rank order."""
    matrix = entry.matrix
    if matrix.rank_list == tuple(range(matrix.size)):
        return
    shape, names = tuple(matrix.shape), tuple(matrix.names)
    raise ValueError(
        f"{_WHO}: entry {index} is a call of Layout({shape}, {names}, rank_list="
        f"{list(matrix.rank_list)}), which orders the devices by its rank_list; AutoParallel "
        f"places the devices in rank order (each rank passes its own block of the input). Use "
        f"the Layout without rank_list: sw.Layout({shape}, {names})"
    )


def input_layout(
    strategy: DatasetStrategy, index: int, ndim: int, count: int, world: int
) -> TensorLayout | None:
    """The layout of input `index` (of `count`, `ndim` dims) under per-input `strategy`;
    None for a named strategy.

    Raises:
        ValueError: not one entry per input, or an entry that does not fit the input / world.
    """
    if isinstance(strategy, str):
        return None
    who = f"{_WHO} input {index}"
    if len(strategy) != count:
        raise ValueError(
            f"{_WHO}: {len(strategy)} entries for {count} tensor inputs; give one per input"
        )
    entry = strategy[index]
    if isinstance(entry, TensorLayout):
        if entry.ndim != ndim:
            raise ValueError(f"{who}: layout {entry} has {entry.ndim} dims, the input {ndim}")
        return resolve_strategy((entry,), world, who=who).layouts[0]
    if len(entry) != ndim:
        raise ValueError(
            f"{who}: strategy {entry} has {len(entry)} values but the input has {ndim} dims"
        )
    return resolve_strategy((entry,), world, who=who).layouts[0]  # one axis per dim
