"""Steps 2 to 4 on this rank: parameter blocks, operator collectives, gradient reduction.

- `data_parallel_layout`: dim 0 split over every axis of the global matrix (the layout in which
  network inputs arrive and the wrapper's outputs leave).
- `shard_parameters` (step 2, apply): replaces each consumed parameter's data by this rank's
  block, cut with `redistribute` from the replicated layout (local slices only, no collective;
  the coordinates are computed from the rank, so it also works in a simulated world); a network
  built inside ``sw.no_init_parameters()`` instead materializes only this rank's blocks
  (`_delayed.materialize_blocks`).
- `apply_comms` (step 3, run): the forward collectives of an `OpPlan` (`AllReduce` sum / mean,
  `ReduceScatter`), with the autograd-aware primitives of `shardwise.communication`.
- `cut_optimizer_state`: optimizer state made before the cut (Adagrad), cut the same way.
- `register_grad_reduction` (step 4, gradients): hooks on every planned parameter that sum its
  partial gradient over the axes on which the parameter is replicated and divide by the world
  size; in a real job asynchronously, overlapping backward (`_GradReduction`).

Groups (`group_for`) are named by the matrix, the axes and the ranks, the same on every rank. In
a real job each rank creates the group it belongs to; in a simulated world the group holding
rank 0 is created and its translates run at once (the matrix must use the default rank_list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise.communication import recorder
from shardwise.communication._collectives import Pending, ReduceOp, all_reduce, all_reduce_async
from shardwise.communication.primitives import sum_over_ranks
from shardwise.layout import DeviceMatrix, TensorLayout
from shardwise.ops import Comm, OpPlan
from shardwise.parallel._delayed import has_deferred, materialize_blocks
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.redistribution import local_block

Shape = tuple[int, ...]


def data_parallel_layout(matrix: DeviceMatrix, ndim: int) -> TensorLayout:
    """Dim 0 split over every axis of `matrix` (outer first), other dims whole."""
    axes = tuple(a for a, s in enumerate(matrix.shape) if s > 1)
    return TensorLayout(matrix, (axes,) + ((),) * (ndim - 1))


def replicated_layout(matrix: DeviceMatrix, ndim: int) -> TensorLayout:
    """Every dim whole on every rank."""
    return TensorLayout(matrix, ((),) * ndim)


def _simulated() -> bool:
    return not isinstance(comm.get_rank(), int)


def group_for(matrix: DeviceMatrix, axes: Sequence[int]) -> tuple[str | None, tuple[int, ...]]:
    """This rank's group along `axes` of `matrix` (None: the world) and its members, ordered by
    coordinate (first axis outer). Created on first use."""
    simulated = _simulated()
    if simulated and matrix.rank_list != tuple(range(comm.get_group_size())):
        raise ValueError(f"in a simulated world {matrix} must span it with the default rank_list")
    members = matrix.group_along(0 if simulated else comm.get_rank(), tuple(axes))
    ranks = tuple(sorted(members))
    if len(ranks) == comm.get_group_size():
        return None, members
    names = ",".join(matrix.names[a] for a in axes)
    name = comm.scoped_group_name(f"parallel:{names}", str(matrix), ranks)
    return comm.ensure_group(name, ranks), members


def _one_comm(x: torch.Tensor, c: Comm, matrix: DeviceMatrix) -> torch.Tensor:
    axes = c.axis_indices(matrix)
    group, members = group_for(matrix, axes)
    if len(members) == 1:
        return x
    if c.kind == "AllReduce":
        return sum_over_ranks(x, group, len(members) if c.op == "mean" else 1)
    if c.kind == "ReduceScatter" and c.op == "sum" and c.dim is not None:
        if tuple(sorted(members)) != members:
            raise UnsupportedParallelError(f"{c}: group order differs from rank order")
        out: torch.Tensor = comm.ReduceScatter("sum", group)(x.movedim(c.dim, 0))
        return out.movedim(0, c.dim)
    raise UnsupportedParallelError(f"collective {c} is not supported by the runtime yet")


def apply_comms(outputs: list[torch.Tensor], plan: OpPlan) -> list[torch.Tensor]:
    """Combine the partial outputs of `plan` (in place in the list, returned)."""
    for c in plan.comms:
        outputs[c.output] = _one_comm(outputs[c.output], c, plan.matrix)
    return outputs


def _owner(network: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (network.get_submodule(path) if path else network), attr


def shard_parameters(network: nn.Module, params: Mapping[str, tuple[TensorLayout, Shape]]) -> None:
    """Replace each parameter's data by this rank's block of it (same Parameter objects, so an
    optimizer built before still holds them).

    A network built inside ``sw.no_init_parameters()`` is materialized here instead, each rank
    keeping only its blocks (`materialize_blocks`: each tensor is generated, cut and freed in
    turn, so no rank holds the whole replicated model).
    """
    if has_deferred(network):
        materialize_blocks(network, params)
        return
    for name, (layout, shape) in params.items():
        owner, attr = _owner(network, name)
        p = getattr(owner, attr)
        if tuple(p.shape) != tuple(shape):
            raise ValueError(f"parameter {name!r} has shape {list(p.shape)}, planned {shape}")
        with torch.no_grad():
            full = p.detach()
            block = local_block(full, layout, shape)
            p.set_(block.clone())  # keeps the Parameter object (`.data =` ignores LocalTensors)


class _GradReduction:
    """The gradient reduction of the planned parameters of one network (see
    `register_grad_reduction`); `pending`: AllReduces started in place in ``.grad``, finished
    (and divided by the world size) at the end of backward by `_finish`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.overlap = isinstance(comm.get_rank(), int)  # (a simulated world: all at once)
        self.pending: list[tuple[torch.Tensor, Pending[torch.Tensor]]] = []
        self.queued_for = -1  # the backward (graph task id) `_finish` is queued for

    def hooks(self, p: torch.Tensor, layout: TensorLayout) -> list[RemovableHandle]:
        """The tensor hook (before accumulation) and post-accumulate hook of parameter `p`."""
        axes = tuple(a for a in layout.replicated_axes() if layout.matrix.shape[a] > 1)
        world, fresh = self.world, [False]
        store = _grad_store(p)

        def before(g: torch.Tensor) -> torch.Tensor:
            if not axes:
                return g / world if world > 1 else g  # (one rank: no copy of the gradient)
            fresh[0] = self.overlap and p.grad is None and g.is_contiguous() and _stores(store)
            if fresh[0]:  # reduced in place in .grad once autograd has stored it (`after`)
                return g
            group, _ = group_for(layout.matrix, axes)  # None: the world group
            with recorder.phase("backward"):  # a gradient hook: no autograd through this sum
                return all_reduce(g, ReduceOp.SUM, group).div_(world)

        def after(param: torch.Tensor) -> None:
            grad = param.grad
            if not fresh[0] or grad is None:
                return
            fresh[0] = False
            group, _ = group_for(layout.matrix, axes)
            with recorder.phase("backward"):
                self.pending.append((grad, all_reduce_async(grad, ReduceOp.SUM, group)))
            task = torch._C._current_graph_task_id()
            if self.queued_for != task:  # (per backward: one that raised never ran its callback)
                self.queued_for = task
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)

        return [p.register_hook(before), p.register_post_accumulate_grad_hook(after)]

    def _finish(self) -> None:
        self.queued_for = -1
        pending, self.pending = self.pending, []
        for grad, started in pending:
            started.wait()
            grad.div_(self.world)


def _grad_store(p: torch.Tensor) -> Any:
    """Autograd's node that stores ``p.grad`` (run by ``backward()``, not by
    ``torch.autograd.grad(loss, params)``); None when `p` needs no gradient."""
    view = p.view_as(p)
    return None if view.grad_fn is None else view.grad_fn.next_functions[0][0]


def _stores(store: Any) -> bool:
    """Whether the running backward stores the gradient into ``.grad`` (node `store`)."""
    if store is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(store))
    except RuntimeError:  # torch refuses leaf nodes inside torch.autograd.grad: nothing stored
        return False


def register_grad_reduction(
    network: nn.Module, params: Mapping[str, tuple[TensorLayout, Shape]]
) -> list[RemovableHandle]:
    """Reduce every planned parameter's gradient; returns the hooks' handles.

    Autograd over the shardwise collectives computes the gradient of the sum over ranks of each
    rank's loss, and a replicated tensor gets partial gradients that sum to its gradient. The
    loss is one value replicated on all ranks, so the true gradient of a parameter block is the
    sum of its partials over the axes it is replicated on, divided by the world size. In a real
    job a gradient that lands in an empty ``.grad`` is all-reduced asynchronously in place
    (started by a post-accumulate hook, one AllReduce per parameter as before, finished at the
    end of backward), so the reductions run while the earlier layers' gradients are computed;
    a gradient accumulating onto an existing ``.grad`` (several backward calls per step), one
    that ``torch.autograd.grad`` returns instead of storing, and a simulated world are reduced
    synchronously in the tensor hook.
    """
    reduction = _GradReduction(comm.get_group_size())
    handles = []
    for name, (layout, _) in params.items():
        owner, attr = _owner(network, name)
        handles += reduction.hooks(getattr(owner, attr), layout)
    return handles


def cut_optimizer_state(
    network: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    params: Mapping[str, tuple[TensorLayout, Shape]],
) -> None:
    """Cut state that `optimizers` made before the parameters were cut to their blocks
    (``Adagrad`` fills ``sum`` at construction) to this rank's block, like the parameters."""
    names = {id(p): n for n, p in network.named_parameters()}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            name = names.get(id(p))
            if name is None or name not in params:
                continue
            layout, shape = params[name]
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and tuple(value.shape) == shape != p.shape:
                    with torch.no_grad():
                        state[key] = local_block(value, layout, shape).clone()
