"""Optimizer-parallel plan: which parameters shard, over which ranks, in which fused buckets.

Pure data, no process group (like every plan in shardwise):

- `HsdpConfig` (`check_hsdp`): ``shard_size``, ``threshold`` (KB), ``optimizer_level``.
- `FusionConfig` (`check_fusion`): MindSpore's ``comm_fusion`` dict (per collective kind a
  mode ``"auto"`` = 64 MB buckets, ``"size"`` = ``config`` MB buckets, ``"index"`` = split
  points by parameter index, AllReduce only); kinds without a mode fuse by ``comm_fusion`` id.
  Both from `_settings`, re-exported here.
- `ParamInfo`: what the planner needs of one parameter (its op-level layout, global shape, dtype,
  ``parallel_optimizer``, fusion id).
- `plan_optimizer` (step 1 of optimizer parallel): a `ParamShard` per parameter (sharded over
  ``k`` ranks of its data-parallel group, or why not) and the `Bucket`s of the collectives, as
  an `OptimizerPlan` with a short printable table.

Sharding rule (seed 001): a parameter whose op-level block is replicated over ``k`` ranks (the
axes it is not split on), whose block's first dim divides by the shard size, whose block holds
at least ``threshold`` KB and whose ``parallel_optimizer`` is True is split along dim 0 over a
shard group of ``shard_size`` ranks (default: all ``k``); the other ``k / shard_size`` copies of
each shard are kept equal by an AllReduce of the reduced gradient. Parameters not divisible are
not sharded (not padded) and say so in the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from shardwise.layout import TensorLayout
from shardwise.optim._settings import (
    FusionConfig,
    HsdpConfig,
    check_points,
)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the op-level plan left it.

    Attributes:
        name: its name in the network.
        layout: its op-level layout on the global matrix.
        shape: its global shape.
        dtype: element type.
        parallel_optimizer: ``sw.Parameter``'s flag (True for plain parameters).
        fusion: its ``comm_fusion`` id.
        requires_grad: trainable.
        equal_axes: replica axes over which every rank's gradient is the same (the plan made
            it equal: ``ParallelPlan.equal_grads``): not reduced over, multiplied by their size.
    """

    name: str
    layout: TensorLayout
    shape: Shape
    dtype: torch.dtype
    parallel_optimizer: bool = True
    fusion: int = 1
    requires_grad: bool = True
    equal_axes: tuple[int, ...] = ()

    @property
    def block(self) -> Shape:
        """This rank's op-level block."""
        return self.layout.local_shape(self.shape)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block) * self.dtype.itemsize


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is reduced and updated.

    Attributes:
        info: the parameter.
        dp_axes: the axes its op-level block is replicated on (size > 1).
        group_size: ``k``, ranks holding the same block.
        shard: ranks sharing one shard group (1: not sharded).
        reason: why it is not sharded ("" when it is).
    """

    info: ParamInfo
    dp_axes: tuple[int, ...]
    group_size: int
    shard: int
    reason: str = ""

    @property
    def sharded(self) -> bool:
        return self.shard > 1

    @property
    def shard_shape(self) -> Shape:
        """This rank's piece: the block's dim 0 cut into `shard` parts."""
        block = self.info.block
        return (block[0] // self.shard, *block[1:]) if self.sharded else block


@dataclass(frozen=True)
class Bucket:
    """Parameters whose collectives run as one (same kind, same groups).

    Attributes:
        kind: ``"shard"`` (AllGather of weights + ReduceScatter of gradients over the shard
            group) or ``"allreduce"`` (gradient AllReduce over the data-parallel group).
        names: the parameters, in order.
        dp_axes: the data-parallel axes of every member.
        shard: the shard group size (1 for allreduce buckets).
        fusion: the fusion id that formed it (-1: formed by size / index).
    """

    kind: Literal["shard", "allreduce"]
    names: tuple[str, ...]
    dp_axes: tuple[int, ...]
    shard: int
    fusion: int

    def __str__(self) -> str:
        what = f"shard over {self.shard}" if self.kind == "shard" else "AllReduce"
        return f"{what} fusion={self.fusion}: {', '.join(self.names)}"


@dataclass(frozen=True)
class OptimizerPlan:
    """Every parameter's `ParamShard` and the buckets of its collectives; ``optimizer_parallel``
    False: planned without hsdp (nothing sharded, gradient AllReduce buckets only; ``config``
    is then the unused default)."""

    config: HsdpConfig
    params: tuple[ParamShard, ...]
    buckets: tuple[Bucket, ...]
    optimizer_parallel: bool = True

    def param(self, name: str) -> ParamShard:
        for p in self.params:
            if p.info.name == name:
                return p
        raise KeyError(name)

    def __str__(self) -> str:
        what = self.config if self.optimizer_parallel else "(no optimizer parallel)"
        lines = [f"OptimizerPlan {what}:"]
        for p in self.params:
            how = f"sharded {p.shard}-way -> {list(p.shard_shape)}" if p.sharded else p.reason
            lines.append(f"  {p.info.name} {list(p.info.block)} fusion={p.info.fusion}: {how}")
        lines += [f"  bucket {b}" for b in self.buckets]
        return "\n".join(lines)


def _decide(info: ParamInfo, config: HsdpConfig | None) -> ParamShard:
    matrix = info.layout.matrix
    replicas = info.layout.replicated_axes()
    axes = tuple(a for a in replicas if matrix.shape[a] > 1 and a not in info.equal_axes)
    k = math.prod(matrix.shape[a] for a in axes)
    if config is None:
        return ParamShard(info, axes, k, 1, "optimizer parallel off")
    s = k if config.shard_size == -1 else config.shard_size
    if k > 1 and k % s:
        raise ValueError(
            f"hsdp: shard_size={config.shard_size} does not divide the data-parallel group of "
            f"parameter {info.name!r} ({k} ranks hold the same block); use a divisor of {k} or -1"
        )
    reason = ""
    if not info.requires_grad:
        reason = "not trainable"
    elif not info.parallel_optimizer:
        reason = "parallel_optimizer=False"
    elif matrix.size == 1:
        reason = "a 1-rank job"
    elif k == 1:
        reason = "no replicas (fully split by its strategy)"
    elif info.block_bytes < config.threshold * 1024:
        reason = f"{info.block_bytes} B < threshold {config.threshold:g} KB"
    elif not info.block:
        reason = "0-d (no dim 0 to shard)"
    elif info.block[0] % s:
        reason = f"dim 0 ({info.block[0]}) not divisible by {s}"
    return ParamShard(info, axes, k, 1 if reason else s, reason)


def _chunks(
    members: Sequence[ParamShard],
    cap: int | None,
    points: tuple[int, ...] | None,
    index: dict[str, int],
) -> list[tuple[list[ParamShard], int]]:
    """Members of one (kind, groups) class cut into buckets: by fusion id, size cap or index."""
    out: list[tuple[list[ParamShard], int]] = []
    if cap == 0:  # fusion off
        return [([p], 0) for p in members]
    if cap is not None or points is not None:
        current: list[ParamShard] = []
        size = 0
        for p in members:
            start = points is not None and index[p.info.name] in points
            full = cap is not None and current and size + p.info.block_bytes > cap
            if current and (start or full):
                out.append((current, -1))
                current, size = [], 0
            current.append(p)
            size += p.info.block_bytes
        if current:
            out.append((current, -1))
        return out
    by_id: dict[int, list[ParamShard]] = {}
    for p in members:
        if p.info.fusion == 0:
            out.append(([p], 0))
        else:
            by_id.setdefault(p.info.fusion, []).append(p)
    return out + [(ps, fid) for fid, ps in sorted(by_id.items())]


def plan_optimizer(
    params: Sequence[ParamInfo], config: HsdpConfig | None, fusion: FusionConfig | None = None
) -> OptimizerPlan:
    """Decide each parameter's sharding and the fused buckets (see the module docstring).

    Args:
        params: the network's parameters, in order.
        config: the hsdp settings; None: no sharding (only gradient AllReduce buckets).
        fusion: the ``comm_fusion`` settings (default: by fusion id).

    Returns:
        The `OptimizerPlan`; buckets in parameter order of their first member.

    Raises:
        ValueError: ``shard_size`` does not divide some parameter's data-parallel group.

    Example:
        >>> print(plan_optimizer(infos, check_hsdp(-1, 64, "level1")))
    """
    fusion = fusion or FusionConfig()
    shards = tuple(_decide(p, config) for p in params)
    index = {p.name: i for i, p in enumerate(params)}
    classes: dict[tuple[str, tuple[int, ...], int, torch.dtype], list[ParamShard]] = {}
    for s in shards:
        if not s.info.requires_grad:
            continue  # no gradient (a bucket without axes only scales by 1 / world)
        kind = "shard" if s.sharded else "allreduce"  # (one flat buffer: one dtype a bucket)
        classes.setdefault((kind, s.dp_axes, s.shard, s.info.dtype), []).append(s)
    buckets: list[tuple[int, Bucket]] = []
    for (kind, axes, shard, _), members in classes.items():
        key = "reducescatter" if kind == "shard" else "allreduce"
        cap = (
            fusion.bucket_bytes(key)
            if kind == "allreduce"
            else (fusion.bucket_bytes("reducescatter") or fusion.bucket_bytes("allgather"))
        )
        cap = cap if fusion.enabled else 0  # 0: fusion off
        points = fusion.split_points(key)
        check_points(points, len(params))
        for group, fid in _chunks(members, cap, points, index):
            names = tuple(p.info.name for p in group)
            bucket = Bucket("shard" if kind == "shard" else "allreduce", names, axes, shard, fid)
            buckets.append((index[names[0]], bucket))
    ordered = tuple(b for _, b in sorted(buckets, key=lambda t: t[0]))
    return OptimizerPlan(config or HsdpConfig(), shards, ordered, config is not None)
