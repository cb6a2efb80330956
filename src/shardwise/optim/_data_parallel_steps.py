"""What `DataParallelRunner` does to a call's tensors and, in the optimizer's step hooks, to the
gradients and parameters: the collectives of data-parallel mode (through
``communication._collectives``), and the batch cut.

- `local_rows` (``"full_batch"``): this rank's rows of a global-batch input
  (`full_batch_rows`: of every tensor input, also inside tuples, lists, dicts and dataclasses:
  `tensors_in`); `same_shapes`: every rank's inputs of one shape (a simulated world sees ranks
  that differ); `same_batch` (``"full_batch"``, first call): every rank's inputs of one value.
- `mean_loss` (train-step form): the step's loss averaged over the ranks (one AllReduce).
- `module_outputs` (module form): the network's loss (a floating 0-d output) averaged over the
  ranks in value only, its gradient this rank's (`RanksMean`); under ``"full_batch"`` every
  other output's rows of every rank, concatenated (``sw.ops.AllGather``, autograd-aware).
- `all_reduce_bucket` (step pre-hook): one gradient bucket averaged over the ranks, one flat
  fused AllReduce of the same size on every rank whichever parameters its rows used (zeros for
  a missing gradient, and per parameter the count of ranks that had one: a parameter no rank
  used keeps ``.grad`` None), a sparse gradient on its own.
- `broadcast_bucket` (step post-hook): one owner's updated parameters sent to every rank, one
  flat Broadcast.
- `check_updates` (after the first train steps): parameters changed without an optimizer step
  the runner hooks (their gradients were not averaged) are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise._torch.storage import version
from shardwise.communication import _collectives as C
from shardwise.communication import every_rank, get_rank, ranks_unlike_leader
from shardwise.communication._grad_sum import sum_gradients, sum_sparse
from shardwise.communication.primitives import AllGather
from shardwise.optim._data_parallel_plan import WHO, ParamEntry, param_ids


def local_rows(x: Any, world: int, rank: int) -> Any:
    """This rank's rows of a global-batch input: dim 0 split over `world` ranks in rank order.

    Non-tensors and 0-d tensors are returned unchanged.

    Args:
        x: one input of the train step.
        world: the number of ranks.
        rank: this rank (a per-rank symbolic int in a simulated world).

    Returns:
        ``x[rank * rows:(rank + 1) * rows]`` with ``rows = x.shape[0] // world``.

    Raises:
        ValueError: dim 0 does not divide by `world` (the message names the shape).

    Example:
        >>> local_rows(torch.arange(8).view(4, 2), 2, 1)
        tensor([[4, 5],
                [6, 7]])
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    shape = [int(s) for s in x.shape]
    if shape[0] % world:
        raise ValueError(
            f"{WHO}: dataset_strategy 'full_batch' (every rank passes the whole global batch, "
            f"cut here into equal rows per rank): an input of shape {shape} has batch dim "
            f"{shape[0]}, not divisible by the {world} ranks; pass a global batch whose size is "
            f"a multiple of {world}, or read the data sharded and use 'data_parallel' (each "
            "rank passes its own rows)"
        )
    rows = shape[0] // world
    return x[rank * rows : (rank + 1) * rows]


def all_reduce_bucket(entries: Sequence[ParamEntry], world: int) -> None:
    """Average the gradients of one bucket's parameters over the ranks, as DDP does: every rank
    sends the same buffer whichever parameters its own rows used (a data-dependent branch takes
    another head on another rank), so the collectives agree.

    The dense members (`_all_reduce_dense`): one flat SUM all-reduce of each member's gradient
    / world (zeros where this rank has none; divided before the sum, as DDP does: a sum of
    float16 gradients, or of a GradScaler's scaled ones, does not overflow where one device's
    gradient is finite) and, in the same buffer, per member the number of ranks that had a
    gradient: a parameter some rank used gets the average on every rank (a rank that did not
    use it contributes zeros), one that no rank used keeps ``.grad`` None on every rank. A
    sparse gradient (``nn.Embedding(sparse=True)``'s weight, `ParamEntry.sparse`, or one
    arriving for a dense member: ``F.embedding(..., sparse=True)``) is summed on its own
    (`_sparse_sum`), on every rank."""
    dense = [e.param for e in entries if not e.sparse]
    if dense:
        _all_reduce_dense(dense, world)
    for e in entries:
        if e.sparse:
            _sparse_sum(e.param, world, 1)


def _all_reduce_dense(params: Sequence[nn.Parameter], world: int) -> None:
    """`all_reduce_bucket`'s flat buffer (`communication._grad_sum.sum_gradients`: each
    member's slot, its gradient / world or zeros, and per member the ranks that had a gradient,
    a sparse one, and its sparse dims), then each member's ``.grad`` set from it: None where no
    rank had one; a sparse one summed on its own after, on every rank when some rank had one."""
    summed = sum_gradients(params, [p.grad for p in params], world, None)
    for p, out in zip(params, summed, strict=True):
        if not out.used:  # (no rank used it: None on every rank, as DDP's unused ones)
            p.grad = None
        elif out.sparse_dim:
            _sparse_sum(p, world, out.sparse_dim)
        elif p.grad is None or p.grad.layout != torch.strided:
            p.grad = out.dense.clone()
        else:
            p.grad.copy_(out.dense)


def _sparse_sum(p: nn.Parameter, world: int, sparse_dim: int) -> None:
    """``p.grad`` (sparse COO; an empty one where this rank has none, a dense one made sparse)
    averaged over the ranks on its own (`communication._grad_sum.sum_sparse`); None on every
    rank when no rank holds a row."""
    p.grad = sum_sparse(p, p.grad, world, None, sparse_dim)


def broadcast_bucket(params: list[nn.Parameter], root: int) -> None:
    """Give every rank the `root` rank's values of `params`: one flat broadcast."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        got = C.broadcast(flat, root, None)
        offset = 0
        for p in params:
            p.copy_(got[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def mean_loss(out: Any, world: int) -> Any:
    """The step's result with every floating scalar tensor (also inside a tuple, list, dict,
    dataclass or other pytree: ``{"loss": loss}``, a model's output) replaced by its mean over
    the ranks (detached); anything else unchanged."""

    def mean(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel() == 1:
            return C.all_reduce(leaf.detach(), C.ReduceOp.SUM, None).div_(world)
        return leaf

    return pytree.tree_map_dataclasses(mean, out)


class RanksMean(torch.autograd.Function):
    """Forward: the ranks' mean of a 0-d value (one AllReduce); backward: the gradient passed
    to this rank's value unchanged (the optimizer step's average over the ranks then makes it
    the global batch's gradient, as for the rank's own loss: nothing is divided twice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int) -> torch.Tensor:
        return C.all_reduce(x.detach(), C.ReduceOp.SUM, None).div_(world)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def module_outputs(out: Any, world: int, full_batch: bool) -> Any:
    """A wrapped module's output (a tensor, or tensors in a tuple, list, dict or dataclass:
    Hugging Face's ``ModelOutput``) as the module form returns it: each floating 0-d tensor
    (the loss: ``out.loss``, ``(loss, logits)``, a bare loss) has the ranks' mean as its value
    and this rank's loss's gradient (`RanksMean`), as semi_auto's 0-d outputs and the train-step
    form's loss are the global batch's; under `full_batch` every other tensor is gathered whole,
    each rank's rows concatenated in rank order (``sw.ops.AllGather``; its backward
    reduce-scatters, which the gradient average turns into the global gradient). A tensor
    returned twice is moved once; anything else is unchanged."""
    done: dict[int, torch.Tensor] = {}

    def leave(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            if x.dim() == 0:
                done[id(x)] = RanksMean.apply(x, world) if x.is_floating_point() else x
            else:
                done[id(x)] = AllGather()(x) if full_batch else x
        return done[id(x)]

    return pytree.tree_map_dataclasses(leave, out)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a call's inputs, also inside tuples, lists, dicts and dataclasses (the
    containers `module_outputs` walks: a cache passed back as it was returned), in order."""
    found: list[torch.Tensor] = []

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    pytree.tree_map_dataclasses(take, tree)
    return found


def full_batch_rows(
    inputs: tuple[Any, ...], kwargs: dict[str, Any], world: int, first: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``"full_batch"``: this rank's rows of every tensor input (`local_rows`), also inside
    tuples, lists, dicts and dataclasses (a ``past_key_values`` cache the module form returned
    whole and the caller passes back), after checking on the `first` call that every rank
    passed rank 0's batch (`same_batch`). A tensor passed twice is cut once."""
    if first:
        same_batch([*inputs, *kwargs.values()])
    rank = get_rank()
    done: dict[int, Any] = {}

    def cut(x: Any) -> Any:  # (a plain tensor made outside a simulated world: every rank's)
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            done[id(x)] = local_rows(every_rank(x), world, rank)
        return done[id(x)]

    rows = pytree.tree_map_dataclasses(cut, (inputs, kwargs))
    return tuple(rows[0]), dict(rows[1])


def same_shapes(inputs: Sequence[Any]) -> None:
    """Raise ValueError when a tensor input (also one inside a tuple, list, dict or dataclass)
    has another size on some of the ranks this process runs (a last batch split unevenly)."""
    for x in tensors_in(list(inputs)):
        try:
            [int(n) for n in x.shape]
        except (AttributeError, TypeError, RuntimeError):
            raise ValueError(
                f"{WHO}: an input of shape {list(x.shape)} has other sizes on some ranks; "
                f"every rank passes the same shapes (as many rows on each rank; "
                f"batch(..., drop_remainder=True) for the last batch)"
            ) from None


def same_batch(inputs: Sequence[Any]) -> None:
    """``"full_batch"``: raise ValueError when a tensor input (also one inside a tuple, list,
    dict or dataclass) differs from rank 0's on some rank (each rank passed its own rows;
    checked through the job's store: `communication.ranks_unlike_leader`)."""
    tensors = tensors_in(list(inputs))
    unlike = ranks_unlike_leader(
        [(f"tensor input {i}", x, lambda r: 0) for i, x in enumerate(tensors)]
    )
    if unlike.count:
        more = f" (and on {unlike.count - 1} more ranks)" if unlike.count > 1 else ""
        raise ValueError(
            f"{WHO}: dataset_strategy 'full_batch': {unlike.name} differs on rank "
            f"{unlike.ranks[0]} from rank 0's{more} (bitwise), but every rank passes the whole "
            f"global batch; pass the same batch on every rank, or use dataset_strategy "
            f"'data_parallel' where each rank passes its own rows"
        )


def check_updates(
    network: nn.Module,
    params: Sequence[torch.Tensor],
    before: Sequence[int],
    stepped: Sequence[torch.optim.Optimizer],
    optimizers: Sequence[torch.optim.Optimizer],
) -> bool:
    """After a train step: whether it changed any trainable parameter of `params` (`before`:
    their versions at its start); raise when one changed without a step of an optimizer the
    runner knows (`stepped`: those that stepped), whose pre-hook averages the gradients (a
    hand-written update; an optimizer it does not know over the network's parameters is
    taken at its first step, `adopt_hook`).

    Raises:
        ValueError: naming the parameter and the fix.
    """
    known = {i for o in stepped for i in param_ids(o)}
    changed = False
    for p, was in zip(params, before, strict=True):
        if version(p) == was or not p.requires_grad:
            continue
        changed = True
        if id(p) not in known:
            name = next((n for n, q in network.named_parameters() if q is p), "?")
            held = ", ".join(type(o).__name__ for o in optimizers) or "none"
            raise ValueError(
                f"{WHO}: the train step changed parameter {name!r} without a step of the "
                f"optimizers the wrapper knows ({held}), so it used this rank's own gradient: "
                "parallel_mode='data_parallel' averages the gradients in a torch.optim "
                "optimizer's step. Build the optimizer before the wrapper (pass it with "
                "optimizer=) and update through it, or use parallel_mode='semi_auto', which "
                "averages them in backward"
            )
    return changed
