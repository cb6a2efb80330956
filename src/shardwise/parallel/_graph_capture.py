"""Capture and plan one call of a network or train step (for `_graph_run.GraphRun`).

- `GraphSession`: the `_shard.Session` while capturing: ``sw.reshard`` becomes the graph op
  `_shard.reshard_value`, parameter plans (``sw.shard(..., parameter_plan=...)``) are
  collected.
- `capture_plan`: `planner.capture` of the call on meta inputs of the global shapes
  (`_call_io.global_inputs`), then `planner.plan_semi_auto` (or, in sharding_propagation,
  `planner.plan_sharding_propagation`) with the declared (or loaded, or kept) parameter
  layouts.
- `check_plan_memory`: the plan (with its gradient or optimizer-parallel buckets) checked
  against ``sw.runtime.set_memory``'s cap, by the one memory model (`report.memory_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import communication as comm
from shardwise import runtime
from shardwise._torch import pytree
from shardwise._transformers import same_masks
from shardwise.layout import TensorLayout
from shardwise.ops._spec_checks import layout_call
from shardwise.optim import OptimizerPlan
from shardwise.parallel._call_io import dataset_shapes, global_inputs, input_layouts
from shardwise.parallel._errors import hidden_inputs_note
from shardwise.parallel._nested_encoders import nested_encoders
from shardwise.parallel._shard import OP_FORM, Declared, Entry, activate, reshard_value
from shardwise.planner import (
    CaptureError,
    Graph,
    ParallelPlan,
    PlanError,
    capture,
    plan_recursive_programming,
    plan_semi_auto,
    plan_sharding_propagation,
)
from shardwise.planner._graph import op_strategy
from shardwise.report._summary import (
    find_optimizer,
    memory_tensors,
    optimizer_state_per_element,
)

T = torch.Tensor
_PLANNERS = {
    "semi_auto": plan_semi_auto,
    "sharding_propagation": plan_sharding_propagation,
    "recursive_programming": plan_recursive_programming,
}


class GraphSession:
    """The `_shard.Session` of a captured network: ``sw.reshard`` becomes the graph op
    `reshard_value` (recorded by the capture, carried out by the executor), and parameter plans
    are collected while capturing."""

    def __init__(self, network: nn.Module) -> None:
        self.network = network
        self.declared: Declared | None = Declared()

    def reshard(self, t: T, entry: Entry, who: str = "sw.reshard", what: str = "") -> T:
        return reshard_value(t, entry, who, what)

    def declare_parameters(self, owner: nn.Module | None, plan: Mapping[str, Entry]) -> None:
        if self.declared is not None:
            self.declared.add(self.network, owner, plan)


_MODULE_OPS = frozenset(
    {
        *("linear", "bilinear", "embedding", "embedding_bag", "multi_head_attention_forward"),
        *("matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "tensordot", "__matmul__"),
    }
)
"""Ops that do what an annotated ``nn.Linear`` / ``nn.Embedding`` does with its weights."""


def check_uncalled_annotations(network: nn.Module, graph: Graph) -> None:
    """Refuse an op-form ``sw.shard`` (on an ``nn.Linear`` / ``nn.Embedding``) whose module the
    first plan's capture never saw called while another op used its weights directly (the
    annotation applies to the module's own call only: it would be silently ignored).

    ``nn.MultiheadAttention`` does this with ``out_proj``: it passes the weights to
    ``F.multi_head_attention_forward``. An annotated module whose weights the step does not
    use at all (a branch on a flag, eval vs train), or only in other ops than a module's own
    (`_MODULE_OPS`: an L2 penalty over the parameters, an EMA), is left alone."""
    owners = {
        id(p): (path, m)
        for path, m in network.named_modules()
        if op_strategy(m) is not None
        for p in m.parameters(recurse=False)
    }
    if not owners:
        return
    ran = {node.module for node in graph.nodes}
    for node in graph.nodes:
        if node.is_primitive:  # (a primitive's inner calls are its own: not recorded)
            continue
        for ref in node.inputs:
            if ref.kind != "param":
                continue
            try:
                found = owners.get(id(network.get_parameter(str(ref.key))))
            except AttributeError:
                continue
            if found is None:
                continue
            path, module = found
            if node.op.rsplit(".", 1)[-1] not in _MODULE_OPS:  # (an L2 penalty, an EMA: fine)
                continue
            inside = node.module == path or node.module.startswith(path + ".")
            if inside or any(r == path or r.startswith(path + ".") for r in ran):
                continue
            kind = next((c.__name__ for c in type(module).__mro__ if c in OP_FORM), "Linear")
            op = node.op.rsplit(".", 1)[-1]
            where = f"in {node.module}" if node.module else "at the top level"
            raise PlanError(
                f"sw.shard on {path} ({type(module).__name__}): its op-form in_strategy never "
                f"applies: {path} is never called as a module during the step; its weights are "
                f"used directly by another op, {op} {where} ({node.source or 'the step'}; e.g. "
                f"nn.MultiheadAttention passes out_proj's weights to "
                f"F.multi_head_attention_forward). Annotate a module that is called, write the "
                f"projection as a called nn.{kind}, or remove the sw.shard annotation"
            )


def check_plan_memory(
    plan: ParallelPlan,
    buckets: OptimizerPlan | None,
    network: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Refuse `plan` when this rank's estimate (`report.memory_tensors`: parameters,
    gradients, optimizer state by hsdp level, activations, communication buffers) is above the
    ``set_memory`` cap, before any parameter is cut (`runtime.check_memory`)."""
    if runtime.get_memory() is None:
        return
    state = optimizer_state_per_element(find_optimizer(network, optimizers))
    runtime.check_memory(memory_tensors(plan, buckets, state), "AutoParallel")


def capture_plan(
    fn: Callable[..., Any],
    network: nn.Module,
    session: GraphSession,
    dataset: object,
    loaded: Mapping[str, TensorLayout],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    stored: ParallelPlan | None = None,
    mode: str = "semi_auto",
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> tuple[Graph, ParallelPlan]:
    """Capture the call `fn(*args, **kwargs)` with the global shapes of its inputs and plan it.

    Args:
        fn: the network or train step.
        network: the network whose parameters the plan stores.
        session: the capture's session (its declared parameter plans are taken once).
        dataset: the dataset strategy (``"data_parallel"``, ``"full_batch"`` or per input).
        loaded: parameter layouts of a loaded strategy file (they win over declared ones).
        args / kwargs: this rank's call.
        stored: a plan whose parameter storage (and global parameter shapes) the new plan
            keeps (a plan made again), or None (the first plan).
        mode: ``"semi_auto"`` (`planner.plan_semi_auto`), ``"sharding_propagation"``
            (`planner.plan_sharding_propagation`) or ``"recursive_programming"``
            (`planner.plan_recursive_programming`).
        optimizers: the job's (or found over the network's parameters): the search holds
            their state per parameter element with each parameter
            (`report.optimizer_state_per_element`).

    Returns:
        The graph and its plan.
    """
    world = comm.get_group_size()
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, T)]
    device = next((t.device for t in tensors if t.device.type != "meta"), None)
    if device is None:  # (meta inputs: `AutoParallel.plan(shapes=...)`)
        device = next((p.device for p in network.parameters()), torch.device("cpu"))
    layouts = input_layouts(dataset, world, args, kwargs)
    g_args, g_kwargs = global_inputs(dataset, world, args, kwargs)
    shapes = None if stored is None else {n: p.shape for n, p in stored.params.items()}
    with activate(session), comm.plain_tensors(), eager(), same_masks(), nested_encoders():
        try:
            graph = capture(
                fn, *g_args, networks=[network], device=device, param_shapes=shapes, **g_kwargs
            )
        except RuntimeError as e:  # (torch's: on global shapes a per-input strategy made?)
            hidden = hidden_inputs_note(args, kwargs)
            if hidden is not None:
                e.add_note(hidden)
            if not layouts:
                raise
            if isinstance(e, CaptureError):  # (its own message and fix: kept, the shapes added)
                e.add_note(_dataset_failed(dataset, world, args, kwargs, None))
                raise
            raise ValueError(_dataset_failed(dataset, world, args, kwargs, e)) from e
        if stored is None:
            check_uncalled_annotations(network, graph)
            assert session.declared is not None
            declared = session.declared.parameter_layouts(network)
            session.declared = None
            given = {n: layout for n, (layout, _) in declared.items()}
            given.update(loaded)  # (a loaded strategy file's storage wins)
        else:
            given = {n: p.layout for n, p in stored.params.items()}
        extra: dict[str, Any] = {}
        if mode == "recursive_programming":  # (its memory holds the optimizer's state)
            optimizer = find_optimizer(network, optimizers)
            extra["state_per_element"] = optimizer_state_per_element(optimizer)
        plan = _PLANNERS[mode](
            graph, world, dataset=layouts or str(dataset), param_layouts=given, **extra
        )
    return graph, plan


def _dataset_failed(
    dataset: object,
    world: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    e: Exception | None,
) -> str:
    """What a call under per-input dataset entries says when its capture raised torch's
    RuntimeError: the global shapes it ran on, and how they were worked out (an input passed
    as other blocks than its entry says gets a wrong one: ``The size of tensor a (8) must match
    the size of tensor b (4)``)."""
    assert isinstance(dataset, tuple)  # (per-input entries)
    shown = [layout_call(x) if isinstance(x, TensorLayout) else str(tuple(x)) for x in dataset]
    entries = ", ".join(shown) + ("," if len(shown) == 1 else "")
    return (
        f"AutoParallel: the step failed while captured on the global shapes that "
        f"dataset_strategy(({entries})) gives its inputs from this rank's blocks "
        f"({dataset_shapes(dataset, world, args, kwargs)}); an input passed as other blocks "
        f"than its entry says (the rows of {world} ranks where the entry splits them fewer "
        f"ways) gets a wrong global shape: pass each input as its entry splits it, or change "
        f"that entry; if these global shapes are right, the step fails on them as one device "
        f"would."
        + ("" if e is None else " torch: " + "\n".join([str(e), *getattr(e, "__notes__", [])]))
    )


def eager() -> Any:
    """``torch.compile``'d code (a compiled module or step) runs eagerly inside wrapped calls:
    the capture records every op, and the plan executor runs them one by one."""
    return torch.compiler.set_stance("force_eager")
