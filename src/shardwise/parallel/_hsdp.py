"""Optimizer parallel inside `AutoParallel`: settings, the plan and the engine.

- `settings_from_context`: ``enable_parallel_optimizer`` / ``parallel_optimizer_config`` /
  ``comm_fusion`` of `set_auto_parallel_context` as `HsdpConfig` / `FusionConfig`.
- `param_infos`: every parameter as the op-level plan left it (planned: its layout; the others:
  whole on every rank), with ``parallel_optimizer`` and ``comm_fusion``.
- `start_engine` (after the op-level blocks are cut): `plan_optimizer`, then an
  `OptimizerParallel` that cuts the shards and from then on reduces every gradient (replacing the
  per-parameter gradient hooks of `_runtime.register_grad_reduction`).
"""

from __future__ import annotations

from torch import nn

from shardwise.optim import (
    FusionConfig,
    HsdpConfig,
    OptimizerParallel,
    ParamInfo,
    check_fusion,
    check_hsdp,
    plan_optimizer,
)
from shardwise.parallel._context import get_auto_parallel_context
from shardwise.parallel._plan import NetworkPlan
from shardwise.parallel._runtime import replicated_layout
from shardwise.parameter import comm_fusion_of, parallel_optimizer_of


def settings_from_context() -> tuple[HsdpConfig | None, FusionConfig | None]:
    """The context's optimizer-parallel and fusion settings (None: not enabled / not set)."""
    hsdp = None
    if get_auto_parallel_context("enable_parallel_optimizer"):
        cfg = get_auto_parallel_context("parallel_optimizer_config")
        hsdp = check_hsdp(
            cfg.get("optimizer_weight_shard_size", -1),
            cfg.get("parallel_optimizer_threshold", 64),
            cfg.get("optimizer_level", "level1"),
        )
    fusion = get_auto_parallel_context("comm_fusion")
    return hsdp, (check_fusion(fusion) if fusion else None)


def param_infos(network: nn.Module, plan: NetworkPlan) -> list[ParamInfo]:
    """Every parameter of `network` with its op-level layout on the plan's matrix."""
    out = []
    for name, p in network.named_parameters():
        if name in plan.params:
            layout, shape = plan.params[name]
        else:
            shape = tuple(int(s) for s in p.shape)
            layout = replicated_layout(plan.matrix, len(shape))
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


def start_engine(
    network: nn.Module,
    plan: NetworkPlan,
    hsdp: HsdpConfig | None,
    fusion: FusionConfig | None,
) -> OptimizerParallel:
    """Plan optimizer parallel for `network` and cut the shards (call once, after the op-level
    blocks are in place)."""
    optimizer_plan = plan_optimizer(param_infos(network, plan), hsdp, fusion)
    engine = OptimizerParallel(network, optimizer_plan, plan.matrix)
    engine.shard_parameters()
    return engine
