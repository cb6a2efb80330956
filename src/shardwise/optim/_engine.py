"""Optimizer parallel at run time: parameters stored as shards, gathered for compute, gradients
reduced in fused buckets straight into the shards (levels 1-3).

`OptimizerParallel` runs an `OptimizerPlan` on this rank. Its constructor sets the state and
registers the step hooks; it inherits the forward (`WeightGathering`, ``_engine_gather``:
`compute`, the level-3 `saved_tensors` / `end_forward`) and the backward (`GradReduction`,
``_engine_reduce``: each bucket's gradients reduced into the shards, `flush` for level 1).
Here:

- `shard_parameters` (apply): each sharded parameter's data becomes its shard (dim 0 of its
  op-level block cut over the shard group); the Parameter object stays, so any optimizer built
  before or after updates shards and keeps 1/k of the state.
- `_before_step` / `_after_step` (global optimizer step hooks, for optimizers holding these
  parameters): cut state made before the parameters were cut (`_adopt_state`), check the
  state has this rank's shard shapes (`check_state`; optimizers refused under optimizer
  parallel: `check_optimizers`), flush level 1; after the step mark the
  leaves stale (levels 1-2) or drop them (level 3, and unsharded parameters' views).
- `_closure_returned` (the module form, `_global_hooks.after_closure`): ``opt.step(closure)``
  runs its closure's forward and backward after the step's pre hooks (or makes the engine
  there, at the wrapper's first call); when the closure returns the same is done again for
  what it made (level 1: its held gradients reduced before the update; nothing pending: no
  collective).

`check_blocks` refuses the same optimizers without optimizer parallel when they step over a
parameter stored as an operator-level block (the wrappers call it at the plan and at each such
optimizer's step: `parallel._step_hooks.refuse_coupled`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise.communication import recorder
from shardwise.communication._collectives import Pending
from shardwise.layout import DeviceMatrix
from shardwise.optim._engine_gather import WeightGathering
from shardwise.optim._global_hooks import (
    after_closure,
    register_post,
    register_pre,
    register_zero_grad,
    remove_later,
)
from shardwise.optim._groups import BucketGroups, bucket_groups
from shardwise.optim._plan import OptimizerPlan, ParamShard
from shardwise.redistribution import local_block

_Token = tuple[str, str]


class OptimizerParallel(WeightGathering):
    """Run `plan` for `network` on this rank (see the module docstring).

    Args:
        network: the network (its parameters already cut to their op-level blocks).
        plan: the optimizer plan.
        matrix: the op-level plan's global device matrix.
        divisor: what the running backward's gradients are divided by before their sums (1
            after a backward seeded with 1 / N, else the world size), read when they come.
        closures: the module form: a step's closure runs the network and its backward outside
            any wrapped call (`_closure_returned` when it returns; a train step's own
            ``opt.step(closure)`` runs inside its call, which reduces at the reads).
    """

    def __init__(
        self,
        network: nn.Module,
        plan: OptimizerPlan,
        matrix: DeviceMatrix,
        divisor: Callable[[], int],
        closures: bool = False,
    ) -> None:
        self.plan = plan
        self.level = plan.config.optimizer_level
        self.world = comm.get_group_size()
        self.divisor = divisor
        self.params = {s.info.name: network.get_parameter(s.info.name) for s in plan.params}
        self.shards = {s.info.name: s for s in plan.params}
        self.bucket_of = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
        self.by_id = {id(p): n for n, p in self.params.items()}
        # groups in bucket order on every rank (member-only groups must be made in one order)
        self.groups = [bucket_groups(matrix, b.dp_axes, b.shard) for b in plan.buckets]
        self.leaves: dict[str, torch.Tensor] = {}
        self._hooked: set[str] = set()  # leaves (by name) given the gradient hook
        self._stale: set[str] = set()  # levels 1-2: leaves kept past the step, refilled in place
        self._versions: dict[str, int] = {}  # each shard's version when its leaf was gathered
        self.ready: dict[int, set[str]] = {}
        self._end_queued = -1  # the backward (graph task id) `_end_backward` is queued for
        self._regathered: dict[int, dict[str, torch.Tensor]] = {}
        self._used: dict[str, bool] = {}
        self._gathered_ids: dict[int, str] = {}  # gathered leaves (level 3 saved-tensor hooks)
        self._gathered_ptrs: dict[tuple[int, ...], list[str]] = {}  # (a bucket's share one)
        self._packed: set[int] = set()  # buckets autograd saved a token of (level 3)
        self.packing = False  # the network runs forward: tokens for saved weights (level 3)
        self._refilled: set[str] = set()  # leaves filled again for a recomputation (level 3)
        self._inflight: list[
            tuple[int, str, Pending[list[torch.Tensor]]]
        ] = []  # started reductions
        self._prefetched: dict[int, Pending[list[torch.Tensor]]] = {}  # next buckets' AGs
        self._regathering: dict[int, Pending[list[torch.Tensor]]] = {}  # level 3, backward
        self.reading = False  # (`reduce_for_read` runs: its own reads of ``.grad``)
        # global hooks hold only a weak reference: a dropped engine (and its network) is freed
        ref = weakref.ref(self)

        def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            engine = ref()
            if engine is not None:
                engine._before_step(optimizer, args, kwargs)

        def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            engine = ref()
            if engine is not None:
                engine._after_step(optimizer, args, kwargs)

        def zeroing(owner: torch.optim.Optimizer | nn.Module, set_to_none: bool) -> None:
            engine = ref()
            if engine is not None:
                engine.zero_held(owner, set_to_none)

        def returned(optimizer: torch.optim.Optimizer) -> None:
            engine = ref()
            if engine is not None:
                engine._closure_returned(optimizer)

        self._handles: list[RemovableHandle] = [register_pre(before), register_post(after)]
        if self.level == "level1":
            self._handles.append(register_zero_grad(zeroing))
        if closures:
            self._handles.append(after_closure(returned))
        weakref.finalize(self, remove_later, self._handles)  # (not mid-step: `_global_hooks`)

    # -- apply -----------------------------------------------------------------------------
    def shard_parameters(self) -> None:
        """Cut every sharded parameter to this rank's shard (same Parameter object)."""
        for i, bucket in enumerate(self.plan.buckets):
            if bucket.kind != "shard":
                continue
            pos = self.groups[i].position
            for name in bucket.names:
                p, shard = self.params[name], self.shards[name]
                rows = shard.shard_shape[0]
                with torch.no_grad():
                    # (`every_rank`: a parameter shared by all simulated ranks is cut per rank,
                    # and `set_` then refuses it, naming the fix, as at the op-level cut)
                    whole = comm.every_rank(p.detach())
                    piece: Any = whole.narrow(0, pos * rows, rows).clone()
                    p.set_(piece)  # keeps the Parameter object (optimizers hold it)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of the parameters this engine manages."""
        return id(t) in self.by_id

    def remove(self) -> None:
        """Remove the global optimizer hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- optimizer step hooks --------------------------------------------------------------
    def _mine(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        return [
            (self.by_id[id(p)], p)
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self.by_id
        ]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        mine = self._mine(optimizer)
        if not mine:
            return
        check_optimizers([optimizer])  # (one the step made, not found at the first call)
        recorder.mark("optimizer step")
        self._ready_for_update(optimizer, mine)

    def _closure_returned(self, optimizer: torch.optim.Optimizer) -> None:
        """The module form: `optimizer`'s closure returned, its gradients made after the
        step's pre hooks (or by the first call, which made this engine): ready them for the
        update as `_before_step` does (level 1: reduced now, the same collectives a step
        without a closure runs at its start, which then found none pending)."""
        mine = self._mine(optimizer)
        if mine:
            self._ready_for_update(optimizer, mine)

    def _ready_for_update(
        self, optimizer: torch.optim.Optimizer, mine: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Finish the collectives, check and adopt `optimizer`'s state, flush level 1."""
        self._drain()  # (already done at the end of backward)
        # a bucket gathered ahead but never used: finish it before the update changes the
        # shards its sends read from
        for pending in self._prefetched.values():
            pending.wait()
        self._prefetched.clear()
        for name, p in mine:
            state = optimizer.state.get(p)
            if state:
                self._adopt_state(name, p, state)
                check_state(name, p, state)
        if self.level == "level1":
            self.flush()

    def _adopt_state(self, name: str, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Cut state an optimizer made before the parameters were cut (``Adagrad`` fills its
        ``sum`` at construction) to this rank's rows: from the global shape or the op-level
        block shape to the shard. Elementwise state of the rows, so exact."""
        shard = self.shards[name]
        info = shard.info
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape == p.shape:
                continue
            with torch.no_grad():
                if tuple(value.shape) == info.shape and info.shape != info.block:
                    value = local_block(value, info.layout, info.shape)
                if tuple(value.shape) == info.block and shard.sharded:
                    pos = self.groups[self.bucket_of[name]].position
                    rows = shard.shard_shape[0]
                    value = comm.every_rank(value).narrow(0, pos * rows, rows)
                state[key] = value.clone()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mine(optimizer):  # the shards changed: gather again at the next forward
            if self.level == "level3":
                self.leaves.clear()
                self._refilled.clear()  # (a backward that raised left them: gone with them)
            else:  # sharded members: refilled in place; the others (views of the parameter): new
                self._stale = {n for n in self.leaves if self.shards[n].sharded}
                self.leaves = {n: leaf for n, leaf in self.leaves.items() if n in self._stale}
            self._gathered_ids.clear()
            self._gathered_ptrs.clear()


ADAFACTOR: type | None = getattr(torch.optim, "Adafactor", None)  # (torch >= 2.5)


def check_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Raise TypeError for an optimizer whose step needs values over whole parameters or all
    of them: ``torch.optim.LBFGS``'s line search (dot products and norms of the flattened
    parameters), ``torch.optim.Adafactor``'s factored row / column statistics and RMS step
    scaling; on shards each rank would take its own."""
    optimizers = list(optimizers)
    if any(isinstance(o, torch.optim.LBFGS) for o in optimizers):
        raise TypeError(
            "AutoParallel: torch.optim.LBFGS cannot step under optimizer parallel (hsdp): its "
            "line search branches on dot products and norms over all the parameters, which "
            "each rank would compute from its own shards (the ranks would diverge); train "
            "without hsdp() with the parameters it steps whole (no operator-level split: "
            "LBFGS works there), or use another optimizer"
        )
    if ADAFACTOR is not None and any(isinstance(o, ADAFACTOR) for o in optimizers):
        raise TypeError(
            "AutoParallel: torch.optim.Adafactor cannot step under optimizer parallel (hsdp): "
            "its factored second moment keeps row and column statistics of each whole "
            "parameter (the column means span all its rows, which dim 0 shards split) and its "
            "relative step scales by the whole parameter's RMS, which each rank would compute "
            "from its own shard (wrong steps, the ranks diverging); train without hsdp() with "
            "the parameters it steps whole (no operator-level split: Adafactor works there), "
            "or use an element-wise optimizer (Adam, AdamW, SGD)"
        )


_WHOLE = {
    "LBFGS": "its line search branches on dot products and norms over all the parameters",
    "Adafactor": "its factored second moment keeps row and column statistics of each whole "
    "parameter and its relative step scales by the whole parameter's RMS",
}


def coupled(optimizer: torch.optim.Optimizer) -> str | None:
    """``"LBFGS"`` / ``"Adafactor"`` for an optimizer whose step needs values over whole
    parameters (`check_optimizers`); None for any other."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS"
    if ADAFACTOR is not None and isinstance(optimizer, ADAFACTOR):
        return "Adafactor"
    return None


def check_blocks(optimizers: Iterable[torch.optim.Optimizer], split: Mapping[int, str]) -> None:
    """Raise ValueError for an ``LBFGS`` or ``Adafactor`` among `optimizers` that steps over a
    parameter stored as this rank's operator-level block (`split`: id of each such parameter
    -> its name): it would take its norms and statistics from the block (`check_optimizers`).

    Example:
        >>> check_blocks([torch.optim.SGD(net.parameters())], {})  # doctest: +SKIP
    """
    for o in optimizers:
        kind = coupled(o)
        held = [split[id(p)] for g in o.param_groups for p in g["params"] if id(p) in split]
        if kind is None or not held:
            continue
        listed = ", ".join(repr(n) for n in held[:3]) + (", ..." if len(held) > 3 else "")
        other = "another optimizer" if kind == "LBFGS" else "an element-wise one (Adam, AdamW, SGD)"
        raise ValueError(
            f"AutoParallel: torch.optim.{kind} steps over parameter(s) {listed}, which the "
            f"plan stores split at operator level (each rank holds a block): {_WHOLE[kind]}, "
            "which each rank would compute from its own block (wrong steps, the ranks "
            f"diverging); keep the parameters {kind} steps whole (no sw.shard / in_strategy "
            f"or plan splitting them: plain data parallel), or use {other}"
        )


def check_state(name: str, p: torch.Tensor, state: dict[str, Any]) -> None:
    """Raise ValueError when optimizer state does not have this rank's shape of `p` (loaded
    from a checkpoint saved with another shard layout, or state an optimizer keeps in another
    shape than its parameter's)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
            raise ValueError(
                f"optimizer state {key!r} of parameter {name!r} has shape {list(value.shape)} "
                f"but this rank holds a shard of shape {list(p.shape)}: either it was loaded "
                f"from a checkpoint saved with another optimizer-parallel layout (hsdp shard "
                f"size / level or device count: load one saved under the same layout), or the "
                f"optimizer keeps state that is not shaped like its parameter (statistics of "
                f"the whole parameter, which a shard cannot hold: train that optimizer without "
                f"hsdp(), or use an element-wise one)"
            )


__all__ = [
    "BucketGroups",
    "OptimizerParallel",
    "ParamShard",
    "check_blocks",
    "check_optimizers",
    "check_state",
    "coupled",
]
