"""The `PlanExecutor` of one `GraphRun` call (`call_executor`, its plan's `NodeTable` from
`plan_table`): the plan's executor with what
the call holds (its inputs, the network whose buffers it re-assigns) and what the run adds
(optimizer parallel's weights, the gradient buckets' count of the loss); `forward_marks`: what
runs when the plan's forward starts and ends (marks, level 3's packing and freeing)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise.communication import recorder
from shardwise.optim import OptimizerParallel
from shardwise.parallel._executor import PlanExecutor
from shardwise.parallel._node_table import NodeTable
from shardwise.parallel._recompute import REENTRANT_HSDP
from shardwise.planner import ParallelPlan


def forward_marks(
    engine: OptimizerParallel | None, first: Callable[[], None]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The calls at the start and the end of the plan's forward: `first` at the start (a
    check of what the step changed before its forward: parameters frozen or unfrozen), a
    recorder mark each, and with optimizer parallel level 3's tokens for saved weights
    (``packing``) and the freeing of the gathered weights (`OptimizerParallel.end_forward`)."""

    def starts() -> None:
        first()
        if engine is not None:
            engine.packing = True
        recorder.mark("forward")

    def done() -> None:
        if engine is not None:
            engine.packing = False
            engine.end_forward()
        recorder.mark("forward done")

    return starts, done


def plan_table(
    tables: dict[int, tuple[ParallelPlan, NodeTable]],
    plan: ParallelPlan,
    templates: list[tuple[Any, Any]],
    dataset: object,
) -> NodeTable:
    """`plan`'s `NodeTable` for `dataset`, made once per plan and kept in `tables` (by the
    plan's id, with the plan)."""
    known = tables.get(id(plan))
    table = known[1] if known is not None and known[0] is plan else None
    if table is None or table.dataset != dataset:
        table = NodeTable(plan, templates, dataset)
        tables[id(plan)] = (plan, table)
    return table


def call_executor(
    plan: ParallelPlan,
    table: NodeTable,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    network: nn.Module,
    engine: OptimizerParallel | None,
    hooks: tuple[Callable[[], None], Callable[[], None]],
    buckets: bool,
    hsdp: bool,
    set_divisor: Callable[[int], None],
    params: Callable[[], dict[int, str]] | None = None,
) -> PlanExecutor:
    """An executor of `plan` (`table`: its `NodeTable`) for one call with arguments `call`.

    Args:
        plan: the plan the call runs.
        table: the plan's node table.
        call: the call's arguments.
        network: the wrapped network (its parameters' names; the buffers the call re-assigns).
        engine: the optimizer-parallel engine (None without ``hsdp()``).
        hooks: what runs when the plan's forward starts and when it ends.
        buckets: the gradients are reduced in buckets (which correct a mean loss's shares).
        hsdp: optimizer parallel is on (reentrant checkpointing is refused).
        set_divisor: told, before each backward of the step, what its gradients are still to
            be divided by (`_seeds`).
        params: parameter id -> its name, called when the executor first needs it (None: from
            ``network.named_parameters()``, a walk of its modules).

    Returns:
        The executor, entered by the caller around the call.

    Example:
        >>> executor = call_executor(plan, table, (a, kw), net, None, hooks, True, False, print)
    """
    on_start, on_end = hooks
    executor = PlanExecutor(
        plan,
        params or (lambda: {id(p): n for n, p in network.named_parameters()}),
        param_value=None if engine is None else engine.compute,
        on_end=on_end,
        on_start=on_start,
        table=table,
    )
    leaves = [t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)]
    executor.inputs = {id(t): weakref.ref(t) for t in leaves}
    executor.network = network  # (the buffers the call re-assigns: `_leaving`)
    executor.set_divisor = set_divisor
    # (the gradient buckets correct a mean loss's shares; an input's gradient they don't)
    executor.defer_count = buckets and not any(t.requires_grad for t in leaves)
    if hsdp:
        executor.reentrant_refused = REENTRANT_HSDP
    if engine is not None and engine.level == "level1":
        executor.grad_read = engine.reduce_for_read
    if engine is not None and engine.level == "level3":
        executor.fill_weights = engine.fill_for_replay
    return executor
