"""Optimizer parallel inside `AutoParallel`: settings, the plan and the engine.

- `settings_from_context`: ``enable_parallel_optimizer`` / ``parallel_optimizer_config`` /
  ``comm_fusion`` of `set_auto_parallel_context` as `HsdpConfig` / `FusionConfig`.
- `param_infos`: every parameter as the op-level plan left it (planned: its layout; the others:
  whole on every rank), with ``parallel_optimizer`` and ``comm_fusion``.
- `optimizer_plan`: with hsdp `plan_optimizer` (which parameters shard, the buckets of their
  collectives), without `gradient_buckets`; `bucket_plans`: its buckets as the `ParallelPlan`
  records them.
- `start_engine` (after the op-level blocks are cut, with hsdp): an `OptimizerParallel` that
  cuts the shards and from then on reduces every gradient.
- `gradient_buckets` (without hsdp): the fused gradient AllReduce buckets that
  `_grad_buckets.GradBuckets` runs: `plan_optimizer` without sharding, by default in buckets of at
  most `DEFAULT_BUCKET_MB` (DDP's 25 MB) filled in reverse parameter order.
- `check_unfrozen`, `check_kinds`, `check_step`: what optimizer parallel refuses (a parameter
  unfrozen after planning, or given another dtype or device; one changed in place by an op of
  the step's plan, `check_param_writes`; ``torch.optim.LBFGS`` and ``torch.optim.Adafactor``,
  `optim.check_optimizers`: the step's, and one whose closure makes the first call,
  `stepping_over`, seen while a wrapper with hsdp lives: `watch_closures`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.nn.grad_reducer import DEFAULT_BUCKET_MB
from shardwise.optim import (
    Bucket,
    FusionConfig,
    HsdpConfig,
    OptimizerParallel,
    OptimizerPlan,
    ParamInfo,
    check_fusion,
    check_hsdp,
    check_optimizers,
    plan_optimizer,
)
from shardwise.optim._global_hooks import stepping, track_closures
from shardwise.parallel._context import get_auto_parallel_context
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._held_clip import ClipArgs, watch
from shardwise.parallel._runtime import Shape, replicated_layout
from shardwise.parameter import comm_fusion_of, parallel_optimizer_of
from shardwise.planner import BucketPlan, Graph
from shardwise.planner._in_place import aliased, written_inputs


def settings_from_context(
    mode: str = "semi_auto",
) -> tuple[HsdpConfig | None, FusionConfig | None]:
    """The context's optimizer-parallel and fusion settings (None: not enabled / not set), for
    a wrapper of parallel `mode` (the data_parallel mode takes a threshold only)."""
    hsdp = None
    if get_auto_parallel_context("enable_parallel_optimizer"):
        cfg = get_auto_parallel_context("parallel_optimizer_config")
        hsdp = check_hsdp(
            cfg.get("optimizer_weight_shard_size", -1),
            cfg.get("parallel_optimizer_threshold", 64),
            cfg.get("optimizer_level", "level1"),
            mode,
        )
    fusion = get_auto_parallel_context("comm_fusion")
    return hsdp, (check_fusion(fusion) if fusion else None)


def param_infos(
    network: nn.Module, matrix: DeviceMatrix, stored: Mapping[str, tuple[TensorLayout, Shape]]
) -> list[ParamInfo]:
    """Every parameter of `network` with its op-level layout on `matrix` (`stored`: name ->
    (storage layout, global shape); the others whole on every rank)."""
    out = []
    for name, p in network.named_parameters():
        if name in stored:
            layout, shape = stored[name]
        else:
            shape = tuple(int(s) for s in p.shape)
            layout = replicated_layout(matrix, len(shape))
        out.append(
            ParamInfo(
                name,
                layout,
                shape,
                p.dtype,
                parallel_optimizer_of(p),
                comm_fusion_of(p),
                p.requires_grad,
            )
        )
    return out


def optimizer_plan(
    network: nn.Module,
    matrix: DeviceMatrix,
    stored: Mapping[str, tuple[TensorLayout, Shape]],
    hsdp: HsdpConfig | None,
    fusion: FusionConfig | None,
    equal: Mapping[str, tuple[int, ...]] | None = None,
) -> OptimizerPlan:
    """The optimizer-parallel plan (with `hsdp`: `plan_optimizer`, which sums every gradient
    over all its replicas) or the gradient AllReduce buckets (without: `gradient_buckets`,
    not summed over the axes `equal` names) of `network` stored as `stored` says."""
    if hsdp is not None:
        return plan_optimizer(param_infos(network, matrix, stored), hsdp, fusion)
    return gradient_buckets(network, stored, fusion, equal)


def bucket_plans(plan: OptimizerPlan, matrix: DeviceMatrix) -> tuple[BucketPlan, ...]:
    """`plan`'s buckets as the `ParallelPlan` records them (axes by name)."""
    level = plan.config.optimizer_level
    return tuple(
        BucketPlan(
            b.kind,
            tuple(matrix.names[a] for a in b.dp_axes),
            b.names,
            b.shard,
            b.fusion,
            level if b.kind == "shard" else "",
        )
        for b in plan.buckets
    )


def start_engine(
    network: nn.Module,
    matrix: DeviceMatrix,
    plan: OptimizerPlan,
    clip_args: ClipArgs,
    divisor: Callable[[], int],
    module_form: bool = False,
) -> OptimizerParallel:
    """Start optimizer parallel for `network` as `plan` (`optimizer_plan` with hsdp) says and
    cut the shards (call once, after the op-level blocks are in place); torch's clipping
    outside a wrapped call takes the norm of the whole gradients, at level 1 of the ones it
    holds (`_held_clip.watch`; its wrapper's `clip_args`); `divisor`: the running backward's
    (`GraphRun.set_divisor`); `module_form`: a step's closure runs the network outside a
    wrapped call (its gradients readied when it returns)."""
    engine = OptimizerParallel(network, plan, matrix, divisor, module_form)
    engine.shard_parameters()
    watch(engine, clip_args)
    return engine


def gradient_buckets(
    network: nn.Module,
    layouts: Mapping[str, tuple[TensorLayout, Shape]],
    fusion: FusionConfig | None,
    equal: Mapping[str, tuple[int, ...]] | None = None,
) -> OptimizerPlan:
    """The gradient AllReduce buckets of `network`'s parameters named in `layouts` (each stored
    in its layout) without optimizer parallel.

    Parameters whose blocks are replicated on the same axes (the AllReduce's group) and share a
    dtype (one flat buffer) are fused, as `plan_optimizer` forms buckets without sharding:
    `fusion` None (no ``comm_fusion``) means DDP's default, buckets of at most
    `DEFAULT_BUCKET_MB` MB; ``comm_fusion`` modes ``size`` / ``auto`` cap them likewise; without
    an ``allreduce`` mode they go by ``comm_fusion`` id (id 0: one per parameter), ``index``
    splits them at parameter indices, ``openstate: False`` gives one per parameter. Size-capped
    buckets are filled in reverse parameter order, the order in which backward produces the
    gradients (as DDP), and listed in that order; the others in parameter order. The weight of
    an ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True`` gets a bucket of its
    own (its sparse gradient is reduced on its own).

    Args:
        network: the network (its parameters cut to their blocks or not).
        layouts: the layout and global shape each parameter is stored in (e.g. the op-level
            plan's, and whole on every rank for the others).
        fusion: the ``comm_fusion`` settings (None: 25 MB buckets).
        equal: parameter -> the axes its gradient is equal on (`ParallelPlan.equal_grads`: not
            reduced over them).

    Returns:
        An `OptimizerPlan` with nothing sharded and ``allreduce`` buckets (a bucket with no
        ``dp_axes`` needs no collective: its gradients are only scaled).
    """
    if fusion is None:
        fusion = FusionConfig({"allreduce": ("size", DEFAULT_BUCKET_MB)})
    infos = [
        ParamInfo(
            name,
            *layouts[name],
            p.dtype,
            parallel_optimizer_of(p),
            comm_fusion_of(p),
            p.requires_grad,
            tuple((equal or {}).get(name, ())),
        )
        for name, p in network.named_parameters()
        if name in layouts
    ]
    backward = fusion.enabled and fusion.bucket_bytes("allreduce") is not None
    planned = plan_optimizer(infos[::-1] if backward else infos, None, fusion)
    dtypes = {info.name: info.dtype for info in infos}
    sparse = sparse_weights(network)
    typed = [b for bucket in planned.buckets for b in _by_dtype(bucket, dtypes)]
    buckets = tuple(b for bucket in typed for b in _alone(bucket, sparse))
    order = {info.name: i for i, info in enumerate(infos)}
    params = tuple(sorted(planned.params, key=lambda s: order[s.info.name]))
    return dataclasses.replace(planned, params=params, buckets=buckets)


def sparse_weights(network: nn.Module) -> set[str]:
    """The weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with
    ``sparse=True``: their gradients are sparse, reduced on their own (`GradBuckets._sparse`)."""
    kinds = (nn.Embedding, nn.EmbeddingBag)
    return {
        f"{path}.weight" if path else "weight"
        for path, m in network.named_modules()
        if isinstance(m, kinds) and m.sparse
    }


def _alone(bucket: Bucket, sparse: set[str]) -> list[Bucket]:
    """`bucket` with its members in `sparse` moved to buckets of their own (no flat buffer
    slot to send for them)."""
    if not sparse.intersection(bucket.names):
        return [bucket]
    dense = tuple(n for n in bucket.names if n not in sparse)
    alone = [dataclasses.replace(bucket, names=(n,)) for n in bucket.names if n in sparse]
    return ([dataclasses.replace(bucket, names=dense)] if dense else []) + alone


def _by_dtype(bucket: Bucket, dtypes: dict[str, torch.dtype]) -> list[Bucket]:
    """`bucket` split into one bucket per dtype of its members (in order of first appearance)."""
    names: dict[torch.dtype, list[str]] = {}
    for n in bucket.names:
        names.setdefault(dtypes[n], []).append(n)
    return [dataclasses.replace(bucket, names=tuple(ns)) for ns in names.values()]


def check_unfrozen(network: nn.Module, before: tuple[bool, ...]) -> None:
    """Raise ValueError when a parameter of `network` requires a gradient that did not when
    optimizer parallel planned its buckets (`before`: `trainable` then)."""
    for (name, p), was in zip(network.named_parameters(), before, strict=False):
        if p.requires_grad and not was:
            raise ValueError(
                f"AutoParallel: parameter {name!r} requires a gradient now but did not when "
                f"optimizer parallel (hsdp) planned its shards and buckets at the first call, "
                f"so its gradient would not be reduced; set requires_grad before the first "
                f"call (and keep a layer still with lr=0 until it trains), or train without "
                f"hsdp(), whose gradient buckets are planned again"
            )


def check_kinds(network: nn.Module, before: tuple[tuple[torch.dtype, torch.device], ...]) -> None:
    """Raise ValueError for a parameter of `network` whose dtype or device is not what it was
    when optimizer parallel planned its shards (`before`: each parameter's then)."""
    for (name, p), (dtype, device) in zip(network.named_parameters(), before, strict=False):
        if p.dtype != dtype or p.device != device:
            raise ValueError(
                f"AutoParallel: parameter {name!r} is {p.dtype} on {p.device} now but was "
                f"{dtype} on {device} when optimizer parallel (hsdp) planned its shards and "
                f"buckets at the first call; change the network's dtype or device (net.to(...), "
                f".half()) before the first call, or train without hsdp(), which plans again"
            )


def check_step(
    graph: Graph, optimizers: Sequence[torch.optim.Optimizer], network: nn.Module
) -> None:
    """Raise for what optimizer parallel refuses in a captured step of `network`: an op
    changing a parameter in place (`check_param_writes`), an optimizer whose step couples all
    the parameters' values or whole parameters' statistics (``LBFGS``, ``Adafactor``:
    `optim.check_optimizers`, a TypeError), among `optimizers` or stepping `network` now
    (`stepping_over`: its update comes after this call, before any hook of the engine)."""
    check_param_writes(graph)
    check_optimizers([*optimizers, *stepping_over(network)])


def watch_closures(owner: object) -> None:
    """Note each optimizer while its step's closure runs (`_global_hooks.track_closures`) for
    as long as `owner` (a wrapper with hsdp) lives: its first call may come inside
    ``opt.step(closure)``, after that step's pre hooks ran (`stepping_over`), and level 1
    reduces the gradients the closure's backward made when it returns (`OptimizerParallel`).
    One hook serves every wrapper; released when `owner` goes (closures then pass unchanged,
    and the hook is removed at the next registration); a second call for `owner` does
    nothing."""
    if owner not in _watched:
        _watched.add(owner)
        weakref.finalize(owner, track_closures().remove)


_watched: weakref.WeakSet[object] = weakref.WeakSet()


def stepping_over(network: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers holding a parameter of `network` whose step's closure runs now (the
    module form's call inside ``opt.step(closure)``; `_global_hooks.stepping`)."""
    ids = {id(p) for p in network.parameters()}
    return [
        o
        for o in stepping()
        if any(id(p) in ids for group in o.param_groups for p in group["params"])
    ]


def check_param_writes(graph: Graph) -> None:
    """Raise UnsupportedParallelError for an op of the step's plan that changes a parameter in
    place (``p.mul_(0.5)`` before an evaluation; through a view: ``p.data.clamp_(-c, c)``,
    ``p.detach().zero_()``): under optimizer parallel the network
    computes with gathered copies of the shards, which such a change would miss."""
    for node in graph.nodes:
        for i in sorted(written_inputs(node)):
            ref = aliased(graph, node.inputs[i])  # (also through a view: ``p.data.clamp_``)
            if ref.kind == "param":
                raise UnsupportedParallelError(
                    f"AutoParallel: {node.op} at {node.source} changes parameter {ref.key} in "
                    "place inside the wrapped step; under optimizer parallel (hsdp) each rank "
                    "stores a shard and the network computes with a gathered copy, which the "
                    "change would miss. Change the weights between calls (the next forward "
                    "gathers them again) or through the optimizer"
                )
