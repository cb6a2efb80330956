"""The inputs of a wrapped call: dataset strategies and how each input arrives.

(Finding a train step's network and optimizers is `_discover`.)

- `check_dataset_strategy`: a dataset strategy's types (a name, or one int tuple / Layout call
  per input, never mixed); `input_layout`: the layout of input i under per-input strategies
  (each entry on its own device matrix, the repeat factor appended on the right as for a
  primitive).
- `arriving_input`: how an input of a wrapped call (module or train step) arrives under a
  dataset strategy, MindSpore's convention: ``"data_parallel"``: each rank passes its own rows
  of the global batch (the ranks' rows in rank order); ``"full_batch"``: each rank passes the
  whole global batch; per-input entries: each rank passes its block of the entry's layout.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import communication as comm
from shardwise.layout import TensorLayout, resolve_strategy
from shardwise.ops import normalize_strategy
from shardwise.parallel._tracker import Tracker

DATASET_STRATEGIES = ("data_parallel", "full_batch")
DatasetStrategy = str | tuple[tuple[int, ...] | TensorLayout, ...]
"""A dataset strategy name, or one entry (split counts or a Layout call) per input."""

_WHO = "dataset_strategy"


def check_dataset_strategy(strategy: object) -> DatasetStrategy:
    """`strategy` checked: ``"data_parallel"``, ``"full_batch"`` or per-input entries.

    Raises:
        ValueError: an unknown name; mixed int tuples and Layouts; a malformed entry.
    """
    if isinstance(strategy, str):
        if strategy not in DATASET_STRATEGIES:
            raise ValueError(
                f"{_WHO}: {strategy!r}; valid: {' | '.join(map(repr, DATASET_STRATEGIES))} or "
                f"one tuple / Layout call per input, e.g. ((8, 1), (8,))"
            )
        return strategy
    out = normalize_strategy(strategy, _WHO, _WHO)
    assert out is not None
    return out


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


def arriving_input(
    x: Any, strategy: DatasetStrategy, tracker: Tracker, index: int = 0, count: int = 1
) -> None:
    """Track input `index` (of `count` tensor inputs) of a wrapped call, as this rank passed
    it: its rows of the global batch (``"data_parallel"``, tracked ``"dp"``, the global batch
    being the ranks' rows in rank order), the whole global batch (``"full_batch"`` and 0-d
    inputs, tracked ``"rep"``: each consumer takes its share by a local slice) or its block
    under input `index`'s layout (per-input entries)."""
    if not isinstance(x, torch.Tensor):
        return
    local = tuple(int(s) for s in x.shape)
    world = comm.get_group_size()
    layout = input_layout(strategy, index, x.dim(), count, world)
    if layout is not None:
        tracker.put(x, layout, tuple(n * layout.split_count(d) for d, n in enumerate(local)))
    elif strategy == "full_batch" and x.dim() > 0:
        tracker.put_batch(x)
    elif x.dim() == 0:
        tracker.put(x, "rep", local)
    else:
        tracker.put(x, "dp", (local[0] * world, *local[1:]))
