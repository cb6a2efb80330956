"""The check that ranks meant to pass the same input did (`check_same_inputs`), once per plan.

Under ``full_batch`` every rank passes the whole global batch; under per-input dataset entries
the ranks a layout leaves an input replicated on pass the same block. A rank that passes other
values (its own rows under ``full_batch``, say) would train on a batch no other rank sees, and
nothing later notices: the first call of each plan compares each tensor input with the one its
leader rank passed (`communication.ranks_unlike_leader`: through the job's store, every rank
raises alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise import communication as comm
from shardwise.layout import TensorLayout
from shardwise.parallel._call_io import input_layouts, tensor_inputs


def _leader(layout: TensorLayout | None) -> Callable[[int], int]:
    """Rank -> the first rank holding the same block (`layout` None: the whole, rank 0's)."""
    if layout is None:
        return lambda r: 0
    axes = layout.replicated_axes()
    return lambda r: min(layout.matrix.group_along(r, axes)) if axes else r


def check_same_inputs(dataset: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise when a rank passed another value of an input than the rank it must match.

    Raises:
        ValueError: naming the input, the ranks that differ, the rank they should match and the
            fix (the same batch on every rank, or ``"data_parallel"``).
    """
    if dataset == "data_parallel":
        return
    layouts = input_layouts(dataset, comm.get_group_size(), args, kwargs)
    named = [
        (key, x, _leader(layouts.get(key)))
        for key, x in tensor_inputs(args, kwargs)
        if dataset == "full_batch" or key in layouts
    ]
    unlike = comm.ranks_unlike_leader(named)
    if not unlike.count:
        return
    shown = list(zip(unlike.ranks, unlike.leaders, strict=True))[:4]
    pairs = ", ".join(f"rank {r} from rank {lead}'s" for r, lead in shown)
    more = f" (and {unlike.count - len(shown)} more ranks)" if unlike.count > len(shown) else ""
    layout = layouts.get(unlike.name)
    what = "every rank passes the whole global batch"
    if layout is not None:
        what = f"ranks holding the same block of it (layout {layout}) pass the same values"
    raise ValueError(
        f"AutoParallel: dataset_strategy {_named(dataset)}: input {unlike.name} differs on "
        f"{pairs}{more} (bitwise), but {what}; pass the same values on those ranks, or set "
        f"dataset_strategy('data_parallel') where each rank passes its own rows"
    )


def _named(dataset: object) -> str:
    return repr(dataset) if isinstance(dataset, str) else "(per input)"
