"""The optimizer-parallel section of ``execute.ir``: every collective the optimizer-parallel
engine (hsdp / comm_fusion buckets) runs per training step on one rank.

`format_optimizer` (pure) writes, per bucket of an `optim.OptimizerPlan` and in bucket order,
its members with this rank's shard shapes and the collectives the engine issues for it:

- a shard bucket: ``AllGather`` of the weights (forward, at the first use of a member; levels
  1-2 start every bucket's gather then, level 3 this one and the next), ``AllGather`` again in
  backward (level 3: the weights were freed after the forward; only a bucket with a member
  backward reads, `planner.regathered_params`: one autograd saved or a checkpointed region
  recomputes with, not a first layer's weight), ``ReduceScatter`` of the
  gradients (level 1: at the optimizer step; levels 2-3: in backward, once the bucket's
  gradients are ready) and ``AllReduce`` of the reduced shard over the copy group (when the
  shard size is smaller than the data-parallel group);
- an all-reduce bucket: ``AllReduce`` of the gradients over the data-parallel group.

The header names the hsdp settings (``# optimizer parallel: hsdp(...)``) or, for a plan made
without hsdp (``OptimizerPlan.optimizer_parallel`` False: the gradient AllReduce buckets only),
``# gradient buckets (no optimizer parallel)``.

Each carries ``when``, ``group`` (the global ranks this rank runs it with), ``group_size`` and
``fusion`` (the bucket's fusion id; -1: formed by size / index); level 2 adds ``send_bytes``
(this rank's bytes by the collective's bound). Collectives over one rank are not run, nor
listed.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from shardwise.communication.recorder import bytes_bound
from shardwise.layout import DeviceMatrix
from shardwise.optim._groups import group_ranks
from shardwise.optim._plan import Bucket, OptimizerPlan

_SCATTER_WHEN = {
    "level1": "optimizer step (before the update)",
    "level2": "backward (the bucket's gradients ready)",
    "level3": "backward (the bucket's gradients ready)",
}


def format_optimizer(
    plan: OptimizerPlan,
    matrix: DeviceMatrix,
    rank: int,
    level: int = 1,
    regathered: Collection[str] | None = None,
) -> str:
    """The optimizer-parallel section of rank `rank`'s ``execute.ir`` (pure).

    Args:
        plan: the optimizer plan (``AutoParallel.optimizer_plan``).
        matrix: the op-level plan's global device matrix.
        rank: the rank whose groups and shard shapes are shown.
        level: the ``save_graphs`` level (2 and 3 add ``send_bytes``).
        regathered: the parameters a level-3 backward gathers again
            (`planner.regathered_params` of the op-level plan); None: every shard bucket's.

    Returns:
        The section's text (lines starting with ``#`` or ``%opt``).

    Example:
        >>> print(format_optimizer(parallel_net.optimizer_plan, plan.matrix, 0))  # doctest: +SKIP
    """
    shards = {p.info.name: p for p in plan.params}
    what = "gradient buckets (no optimizer parallel)"
    if plan.optimizer_parallel:
        what = f"optimizer parallel: {plan.config}"
    lines = [f"# {what}; collectives per training step"]
    total, count = 0, 0
    for i, bucket in enumerate(plan.buckets):
        members = ", ".join(
            f"{n} {list(shards[n].info.block)} -> {list(shards[n].shard_shape)}"
            for n in bucket.names
        )
        lines.append(f"# bucket {i} ({bucket.kind}, fusion {bucket.fusion}): {members}")
        again = regathered is None or not set(bucket.names).isdisjoint(regathered)
        for kind, when, ranks, numel in _collectives(plan, bucket, matrix, rank, again):
            count += 1
            itemsize = shards[bucket.names[0]].info.dtype.itemsize
            sent = bytes_bound(kind, numel * itemsize, len(ranks))
            total += sent
            attrs = f"when: {when}, group: {list(ranks)}, group_size: {len(ranks)}"
            attrs += f", fusion: {bucket.fusion}"
            if level >= 2:
                attrs += f", send_bytes: {sent}"
            lines.append(f"%opt{count} = {kind}({', '.join(bucket.names)}) {{{attrs}}}")
    if level >= 2:
        what = "optimizer-parallel" if plan.optimizer_parallel else "gradient-bucket"
        lines.append(f"# {what} bytes this rank sends per step: {total}")
    return "\n".join(lines) + "\n"


def _collectives(
    plan: OptimizerPlan, bucket: Bucket, matrix: DeviceMatrix, rank: int, again: bool
) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(kind, when, group ranks, input elements) of every collective of `bucket` on `rank`
    (`again`: level 3 gathers the bucket again in backward)."""
    shards = [p for p in plan.params if p.info.name in bucket.names]
    level = plan.config.optimizer_level
    shard_ranks, copy_ranks = group_ranks(matrix, bucket.dp_axes, bucket.shard, rank)
    if bucket.kind != "shard":
        numel = sum(math.prod(p.info.block) for p in shards)
        ready = "backward (the bucket's gradients ready)"
        return [("AllReduce", ready, copy_ranks, numel)] if len(copy_ranks) > 1 else []
    piece = sum(math.prod(p.shard_shape) for p in shards)
    whole = piece * bucket.shard
    out = [("AllGather", "forward (first use of a member)", shard_ranks, piece)]
    if level == "level3" and again:
        when = "backward (freed after forward; a member saved or recomputed with)"
        out.append(("AllGather", when, shard_ranks, piece))
    out.append(("ReduceScatter", _SCATTER_WHEN[level], shard_ranks, whole))
    if len(copy_ranks) > 1:
        copies = f"after the ReduceScatter, over the {len(copy_ranks)} copies"
        out.append(("AllReduce", copies, copy_ranks, piece))
    return [c for c in out if len(c[2]) > 1]
