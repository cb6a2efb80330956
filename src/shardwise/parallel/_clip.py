"""Gradient clipping by the norm of the whole gradients, as one device clips.

Under `AutoParallel` each parameter holds this rank's block (with hsdp: its shard) and that
block's gradient, so torch's ``clip_grad_norm_`` would take the norm of this rank's pieces:
another norm on each rank, and another clipping than one device's. While a wrapped call runs
(`clipping`), torch's clipping takes its total norm from `_TotalNorm` instead
(`_torch.clip_grad`: every call of ``torch.nn.utils.clip_grad_norm_``, however it was
imported):

1. `GradSplits` (a wrapper's view of its parameters) says, for each gradient, which device
   axes split it (its parameter's stored layout; none for a whole one), or, for a parameter of
   the optimizer-parallel engine, which ranks count it (`Copies`: each distinct shard or block
   once, on the lowest rank holding it);
2. the gradients split over the same axes are one group: the norm of this rank's blocks
   (torch's own total norm), combined over the ranks of those axes (an AllReduce of the p-th
   powers, or of the maxima for the inf-norm: one per group); the engine's gradients are one
   group too, each gradient's p-th power counted on its counting ranks only, summed over all
   ranks (one AllReduce);
3. the total is the norm of the groups' norms, the same on every rank and equal to one
   device's; torch then scales every gradient by ``min(1, max_norm / (total + 1e-6))``.

hsdp level 1 keeps each rank's full gradients until the optimizer step reduces them: there the
first clipping of a step reduces them first (`reduce_first`: the collectives the step would
run, moved earlier), and since torch listed the gradients before that, the norm is taken when
torch scales them (`_TotalNorm.scale`, which sees the parameters) and written into the value
torch returns. In the data-parallel mode (gradients reduced at the step by the runner) the
clipping is refused with a ValueError naming why and the fix. Outside a call,
`AutoParallel.clip_grad_norm_` clips the same way (`clip_grad_norm_`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from shardwise import communication as comm
from shardwise._torch.clip_grad import TORCH_CLIP_WITH_NORM, TORCH_TOTAL_NORM, total_norm_replaced
from shardwise.communication import AllReduce, ReduceOp
from shardwise.layout import DeviceMatrix
from shardwise.optim import OptimizerPlan, ParamShard
from shardwise.planner import ParallelPlan

if TYPE_CHECKING:
    from shardwise.parallel._graph_run import GraphRun


class Copies(NamedTuple):
    """A gradient held alike by several ranks (an optimizer-parallel shard, or a block on
    every replica): `first[r]` says whether global rank r is the lowest rank holding the piece
    rank r holds, the one that counts it in the norm."""

    first: tuple[bool, ...]


GradSplit = tuple[DeviceMatrix, tuple[int, ...]] | Copies | None
"""The matrix and the axes (each of size > 1) that split a gradient, its `Copies`; None: whole."""

GradSplits = Callable[[Sequence[torch.Tensor]], list[GradSplit]]
"""Each gradient's `GradSplit` (a tensor that is no parameter's gradient: None)."""

DATA_PARALLEL = (
    "clip_grad_norm_ inside a parallel_mode='data_parallel' train step: the gradients are this "
    "rank's own until the optimizer step all-reduces them, so each rank would clip by another "
    "norm; use parallel_mode='semi_auto' (the same data-parallel plan, gradients reduced in "
    "backward), where it clips by the norm of the whole gradients"
)
DATA_PARALLEL_VALUE = (
    "clip_grad_value_ inside a parallel_mode='data_parallel' train step: the gradients are "
    "this rank's own until the optimizer step all-reduces them, so each rank would clip its "
    "own gradient (the mean of clipped gradients is not the clipped mean); use "
    "parallel_mode='semi_auto' (the same data-parallel plan, gradients reduced in backward), "
    "where it clips the whole gradients"
)


def copies(shard: ParamShard) -> Copies:
    """Which ranks count the gradient of optimizer-parallel parameter `shard` (its stored
    piece: rows of its op-level block cut over the shard group, or the whole block).

    Example:
        >>> copies(optimizer_plan.param("wte.weight")).first  # doctest: +SKIP
        (True, True, False, False)
    """
    layout, shape = shard.info.layout, shard.info.shape
    matrix = layout.matrix
    seen: set[Any] = set()
    first = []
    for r in range(matrix.size):
        pos = 0
        if shard.sharded:
            pos = matrix.group_along(r, shard.dp_axes).index(r) % shard.shard
        key = (layout.local_ranges(r, shape), pos)
        first.append(key not in seen)
        seen.add(key)
    return Copies(tuple(first))


class PlanSplits:
    """The `GradSplits` of `network`'s parameters' gradients, stored as `plan` (and, with
    optimizer parallel, `optimizer`) says (`copies` worked out when a clipping first asks)."""

    def __init__(
        self, network: nn.Module, plan: ParallelPlan, optimizer: OptimizerPlan | None = None
    ) -> None:
        self.network, self.plan = network, plan
        self.shards = {s.info.name: s for s in optimizer.params} if optimizer else {}
        self.counted: dict[str, Copies] = {}
        self.blocks = bool(self.shards) or any(p.layout.is_split() for p in plan.params.values())
        # (some gradient is this rank's piece of a whole one)

    def split(self, name: str | None) -> GradSplit:
        """Parameter `name`'s gradient's `GradSplit` (None: whole, or no parameter)."""
        if name is None or name not in self.plan.params:
            return None
        if name in self.shards:
            if name not in self.counted:
                self.counted[name] = copies(self.shards[name])
            return self.counted[name]
        layout = self.plan.params[name].layout
        m = layout.matrix
        axes = tuple(a for a in layout.used_axes() if m.shape[a] > 1)
        return (m, axes) if axes else None

    def names(self, grads: Sequence[torch.Tensor]) -> list[str | None]:
        """The parameter each gradient is the ``.grad`` of (None: no parameter's)."""
        by_id = {id(p.grad): n for n, p in self.network.named_parameters() if p.grad is not None}
        return [by_id.get(id(g)) for g in grads]

    def __call__(self, grads: Sequence[torch.Tensor]) -> list[GradSplit]:
        return [self.split(n) for n in self.names(grads)]


def plan_splits(
    network: nn.Module, plan: ParallelPlan, optimizer: OptimizerPlan | None = None
) -> PlanSplits:
    """The `GradSplits` of `network`'s parameters' gradients (`PlanSplits`).

    Example:
        >>> plan_splits(net, plan)([p.grad for p in net.parameters()])  # doctest: +SKIP
        [(DeviceMatrix(...), (1,)), None, ...]
    """
    return PlanSplits(network, plan, optimizer)


class _TotalNorm:
    """torch's total norm of gradients, of the whole gradients (the module docstring); with
    `reduce_first` (hsdp level 1) the gradients are reduced first and the norm is taken when
    torch scales them (`scale`)."""

    def __init__(
        self,
        splits: GradSplits | None,
        refused: str,
        reduce_first: Callable[[bool], bool] | None = None,
        where: str = "inside AutoParallel",
    ) -> None:
        self.splits, self.refused, self.reduce_first = splits, refused, reduce_first
        self.where = where  # (the messages' words for where the clipping runs)
        self.deferred: dict[int, tuple[float, bool, bool | None]] = {}  # id(norm) -> its args

    def __call__(
        self,
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        if self.refused or self.splits is None:
            raise ValueError(self.refused)
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if float(norm_type) == 0:
            raise ValueError(
                "clip_grad_norm_ / get_total_norm with norm_type 0 (torch counts the gradients "
                f"that are not all zero) is not supported {self.where} with split or sharded "
                "gradients; use norm_type 2, 1 or inf"
            )
        if self.reduce_first is not None and self.reduce_first(True):
            # (torch listed the gradients before they were reduced: the norm is taken in `scale`)
            like = grads[0] if grads else torch.empty(())
            norm = torch.full((), float("nan"), dtype=like.dtype, device=like.device)
            self.deferred[id(norm)] = (float(norm_type), error_if_nonfinite, foreach)
            return norm
        return self.norm(grads, float(norm_type), error_if_nonfinite, foreach)

    def norm(
        self, grads: list[torch.Tensor], p_norm: float, error_if_nonfinite: bool, foreach: Any
    ) -> torch.Tensor:
        """The norm of the whole gradients of which `grads` are this rank's pieces."""
        assert self.splits is not None
        if not grads:
            return TORCH_TOTAL_NORM(grads, p_norm, error_if_nonfinite, foreach)  # type: ignore[no-any-return]
        groups: dict[Any, list[torch.Tensor]] = {}
        counted: list[tuple[torch.Tensor, Copies]] = []
        for g, split in zip(grads, self.splits(grads), strict=True):
            if isinstance(split, Copies):
                counted.append((g, split))
            else:
                groups.setdefault(split, []).append(g)
        norms = []
        for split, members in groups.items():
            local = TORCH_TOTAL_NORM(members, p_norm, False, foreach)
            norms.append(local if split is None else _over_ranks(local, p_norm, *split))
        if counted:
            norms.append(_counted_once(counted, p_norm))
        return TORCH_TOTAL_NORM(norms, p_norm, error_if_nonfinite, foreach)  # type: ignore[no-any-return]

    def public(
        self,
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.get_total_norm`` (the two-step form: the gradients listed by the
        caller; inside a wrapped call, or outside one over an hsdp wrapper's gradients): the
        norm of the whole gradients; refused while hsdp level 1 holds gradients unreduced (the
        listed ones are not all of them)."""
        splits = self.splits
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if isinstance(splits, PlanSplits) and splits.blocks and None in splits.names(grads):
            raise ValueError(
                f"torch.nn.utils.get_total_norm {self.where} got a tensor that is no "
                "parameter's .grad (a copy?): each rank holds pieces of split or sharded "
                "gradients, and only the parameters' own .grad tensors tell which; pass "
                "[p.grad for p in params] or use torch.nn.utils.clip_grad_norm_"
            )
        if self.reduce_first is not None and self.reduce_first(False):
            raise ValueError(
                f"torch.nn.utils.get_total_norm {self.where} with hsdp optimizer_level "
                "'level1': the gradients are held unreduced until the optimizer step, so the "
                "ones listed are not all of them; use torch.nn.utils.clip_grad_norm_ (it "
                "reduces them first) or optimizer_level='level2'"
            )
        return self(grads, norm_type, error_if_nonfinite, foreach)

    def scale(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        total_norm: torch.Tensor,
        foreach: bool | None = None,
    ) -> None:
        """torch's scaling step; a norm `__call__` deferred is taken here first, from the
        gradients the parameters hold now, and written into the tensor torch returns."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        args = self.deferred.pop(id(total_norm), None)
        if args is not None:
            grads = [p.grad for p in params if p.grad is not None]
            with torch.no_grad():
                total_norm.copy_(self.norm(grads, *args))
        TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)


def _over_ranks(
    local: torch.Tensor, p_norm: float, matrix: DeviceMatrix, axes: tuple[int, ...]
) -> torch.Tensor:
    """The norm of a group's blocks over the ranks of `axes` from this rank's (`local`)."""
    from shardwise.parallel._runtime import group_for  # (the runtime imports this module)

    group, _ = group_for(matrix, axes)
    with torch.no_grad():
        if p_norm == float("inf"):
            return AllReduce(ReduceOp.MAX, group)(local)  # type: ignore[no-any-return]
        summed = AllReduce(ReduceOp.SUM, group)(local.double() ** p_norm)
        return (summed ** (1.0 / p_norm)).to(local.dtype)  # type: ignore[no-any-return]


def _counted_once(members: list[tuple[torch.Tensor, Copies]], p_norm: float) -> torch.Tensor:
    """The norm of the whole gradients held as `members` (pieces and where they count), over
    all ranks: one AllReduce of the counted pieces' p-th powers (of the maxima for the inf-norm,
    where copies do not matter)."""
    grads = [g for g, _ in members]
    with torch.no_grad():
        norms = torch.stack([torch.linalg.vector_norm(g, p_norm) for g in grads])
        if p_norm == float("inf"):
            return AllReduce(ReduceOp.MAX)(norms.max())  # type: ignore[no-any-return]
        device = norms.device
        counts = comm.rank_value(
            lambda r: torch.tensor([float(c.first[r]) for _, c in members], dtype=torch.float64)
        ).to(device)
        summed = AllReduce(ReduceOp.SUM)((norms.double() ** p_norm * counts).sum())
        return (summed ** (1.0 / p_norm)).to(norms.dtype)  # type: ignore[no-any-return]


@contextmanager
def clipping(
    splits: GradSplits | None, refused: str = "", reduce_first: Callable[[bool], bool] | None = None
) -> Iterator[None]:
    """While the block runs, torch's clipping takes the norm of the whole gradients (`splits`:
    the running wrapper's; `reduce_first`: reduces gradients held unreduced, hsdp level 1), or
    is refused with ValueError(`refused`)."""
    total = _TotalNorm(splits, refused, reduce_first)
    grouping = _refuse(DATA_PARALLEL_VALUE) if refused == DATA_PARALLEL else None
    with total_norm_replaced(total, total.scale, total.public, grouping):
        yield


def _refuse(message: str) -> Callable[..., Any]:
    def grouping(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(message)

    return grouping


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    splits: GradSplits | None,
    refused: str = "",
    reduce_first: Callable[[bool], bool] | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the norm of the whole gradients (`splits`), or
    the ValueError `refused` (for `AutoParallel.clip_grad_norm_`, outside a wrapped call).

    Example:
        >>> clip_grad_norm_(net.parameters(), 1.0, 2.0, False, plan_splits(net, plan))
    """
    with clipping(splits, refused, reduce_first):
        out: torch.Tensor = nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite
        )
    return out


class Clipping:
    """`AutoParallel.clip_grad_norm_` (`AutoParallel` sets the attributes below)."""

    parallel_mode: str
    network: nn.Module
    _graph: GraphRun | None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the network's gradients by the norm of the whole gradients, as one device's
        ``torch.nn.utils.clip_grad_norm_(network.parameters(), ...)`` does; for code outside
        a wrapped call (inside one, torch's own function clips this way).

        Args:
            max_norm / norm_type / error_if_nonfinite: as torch's.

        Returns:
            The total norm of the whole gradients, the same on every rank.

        Raises:
            ValueError: before the first call or in the data-parallel mode (the message says
                why and what to do), or a norm_type of 0.

        Example:
            >>> loss = parallel_net(x).sum()
            >>> loss.backward()
            >>> parallel_net.clip_grad_norm_(1.0)
        """
        params, graph = self.network.parameters(), self._graph
        if self.parallel_mode == "data_parallel":
            return clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite, None, DATA_PARALLEL
            )
        if graph is None or not graph.plans:
            raise ValueError("AutoParallel.clip_grad_norm_: call the wrapper first (no plan yet)")
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, *graph.clip_args())
