"""Training-mode ``F.batch_norm`` on rows split across ranks: kept split, statistics shared.

DTensor's rule for a training batch norm gathers the batch (the statistics need all of it), and
everything after the first BatchNorm of a network would then run whole on every rank.
`split_batch_norm` tells the planner to keep the input's rows split instead (its placement in
and out, the parameters and running statistics whole) and to mark the node
(`NodePlan.local` = `SPLIT_BATCH_NORM`): the executor gathers each rank's per-channel mean and
sum of squared deviations over the axes splitting the rows (one AllGather, autograd-aware),
combines them into the whole batch's, and normalizes its rows with those (as one device would),
updating the running statistics the same way on every rank (`parallel/_local.batch_norm_split`).
`stats_gather` is that AllGather as the plan lists it (also for the ``BatchNorm`` primitive).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise.layout import TensorLayout
from shardwise.planner._graph import Node
from shardwise.planner._placed import Collective

SPLIT_BATCH_NORM = "split_batch_norm"
"""`NodePlan.local` of a training batch norm whose rows stay split."""

BATCH_NORM = "torch.nn.functional.batch_norm"
BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
"""``F.batch_norm``'s parameters in order (`parallel/_local.batch_norm_split` reads them)."""


def split_batch_norm(node: Node, have: Sequence[Sequence[Placement]]) -> bool:
    """Whether `node` is a training-mode ``F.batch_norm`` whose input arrives split on its rows
    only (`have`: its inputs' placements per mesh dim), which then stays split.

    Example:
        >>> split_batch_norm(node, [(Shard(0),), (Replicate(),), (Replicate(),)])  # doctest: +SKIP
        True
    """
    if node.op != BATCH_NORM or not have:
        return False
    at = BN_ARGS.index("training")
    training = node.kwargs.get("training", node.args[at] if len(node.args) > at else False)
    if training is not True:
        return False
    first = have[0]
    rows = any(isinstance(p, Shard) and p.dim == 0 for p in first)
    return rows and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in first
    )


def stats_gather(
    where: str, layout: TensorLayout, shape: Sequence[int], dtype: str
) -> tuple[Collective, ...]:
    """The AllGather of a training batch norm's per-channel statistics (this rank's mean and
    sum of squared deviations, ``[1, 2, C]``, float32 for half types) over the axes splitting
    its input's N, H or W (`layout`, global `shape`), as the plan lists it; none when no axis
    does."""
    axes = sorted(
        a for d, ds in enumerate(layout.dims) if d != 1 for a in ds if layout.matrix.shape[a] > 1
    )
    if not axes or len(shape) < 2:
        return ()
    kind = getattr(torch, dtype)
    itemsize = 4 if kind in (torch.float16, torch.bfloat16) else kind.itemsize
    channels = layout.local_shape(shape)[1]
    names = tuple(layout.matrix.names[a] for a in axes)
    block = 2 * channels * itemsize
    return (Collective("AllGather", names, where, "batch statistics", block=block),)
