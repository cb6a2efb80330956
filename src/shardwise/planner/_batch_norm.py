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

`cumulative_momenta`: while a capture runs, a training ``nn.BatchNorm*`` with ``momentum=None``
(a cumulative moving average: torch computes its factor ``1 / num_batches_tracked`` with
``float()``, a value a fake buffer lacks) gets that factor as its ``momentum``, computed from
its real ``num_batches_tracked`` (a replicated buffer, equal on every rank) and the calls the
capture has made of it so far; the call the plan is captured from then passes the captured
factor, and later calls pass their own (`parallel/_sizes`: a number that changes from call to
call is the call's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
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


_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _tracked(module: nn.Module) -> int:
    """How many batches `module` (a batch norm) has counted; 0 for an unmaterialized one."""
    count = module.num_batches_tracked
    assert isinstance(count, torch.Tensor)
    return 0 if count.device.type == "meta" else int(count)


@contextmanager
def cumulative_momenta(networks: Sequence[nn.Module]) -> Iterator[None]:
    """While a capture of `networks` runs (entered before their buffers become fake): each
    training batch norm with ``momentum=None`` runs with ``momentum`` set to the factor torch
    would compute, ``1 / (num_batches_tracked + calls)``, its ``num_batches_tracked`` read
    from the real buffer here (see the module docstring); put back to None after each call.

    Example:
        >>> with cumulative_momenta([net]):  # doctest: +SKIP
        ...     net(fake_x)  # a BatchNorm1d(8, momentum=None) runs with momentum 1 / (n + 1)
    """
    norms = [
        m
        for net in networks
        for m in net.modules()
        if isinstance(m, _NORMS) and m.momentum is None and m.num_batches_tracked is not None
    ]
    counts = {id(m): _tracked(m) for m in norms}

    def pre(module: nn.Module, args: Any) -> None:
        if module.training and getattr(module, "track_running_stats", False):
            counts[id(module)] += 1
            setattr(module, "momentum", 1.0 / counts[id(module)])  # noqa: B010

    def post(module: nn.Module, args: Any, out: Any) -> None:
        setattr(module, "momentum", None)  # noqa: B010

    handles = [
        h
        for m in norms
        for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post, always_call=True))
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in norms:
            m.momentum = None
