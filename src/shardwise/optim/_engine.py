"""Optimizer parallel at run time: parameters stored as shards, gathered for compute, gradients
reduced in fused buckets straight into the shards (levels 1-3).

`OptimizerParallel` runs an `OptimizerPlan` on this rank:

- `shard_parameters` (apply): each sharded parameter's data becomes its shard (dim 0 of its
  op-level block cut over the shard group); the Parameter object stays, so any optimizer built
  before or after updates shards and keeps 1/k of the state.
- `compute` (forward): the tensor the network computes with, a *compute leaf* per parameter and
  step: for a sharded parameter its op-level block, gathered with one AllGather per bucket
  (`communication._buckets.all_gather_bucket`) on first use, for the others a view of the
  parameter. Leaves are reused until the optimizer steps; at levels 1-2 a sharded one is kept
  past the step (`_stale`) and the next gather writes into it in place (same tensor, storage
  and hook: no new buffer per step; its version moves, so autograd refuses a graph kept from
  before, as for a weight updated in place on one device). Prefetch (`_prefetch`): at levels 1-2
  the first use of a shard bucket starts every shard bucket's gather (all are kept until
  backward anyway); level 3 starts the bucket in use and the next one. Gathers started
  together are coalesced (`communication._pairwise.coalesced`: on gloo one message per peer
  instead of one per bucket; still one recorded AllGather per bucket).
- `_on_grad` (backward): each leaf's post-accumulate-grad hook; when every used leaf of a bucket
  has its gradient, the bucket is reduced (`_reduce`): one ReduceScatter over the shard group of
  the bucket's gradients (`reduce_scatter_bucket`: each rank receives its dim-0 chunk of every
  member), an AllReduce over the copy group when the shard group is smaller than the
  data-parallel group, or one AllReduce for unsharded members; then / world size (the loss is
  one value replicated on every rank) and added to ``param.grad``. The ReduceScatters are
  started asynchronously and finished (`_drain`) at the end of backward, so they run while the
  earlier layers' gradients are computed. Level 1 keeps the full-size gradients on the leaves
  and reduces at the optimizer's step (`flush`, a global step pre-hook: every bucket started,
  coalesced, then all finished); levels 2 and 3 reduce in backward, as soon as a bucket is
  complete. A bucket left incomplete (unused parameters) is reduced at the end of backward.
- Level 3 (`saved_tensors`, `end_forward`): the gathered weights are not kept for backward:
  autograd saves a token instead (saved-tensor hooks) and `_unpack` gathers the bucket again in
  backward, starting the previous saved bucket's gather too (prefetch: backward runs the layers
  in reverse); the leaves' storage is freed after the forward (`communication.rank_parts`: the
  storage of every rank this process runs), and a second forward before the optimizer steps
  (gradient accumulation) gathers it again into the same leaves (`_refill`).
- A backward that raised midway (`_drop_unfinished_backward`, run by the next forward): its
  started collectives are finished and dropped, its partial buckets, re-gathers and (levels
  2-3) leaf gradients forgotten; the end-of-backward callback is queued once per backward
  (graph task), so the next backward still gets one.
- `_before_step` / `_after_step` (global optimizer step hooks, for optimizers holding these
  parameters): cut state made before the parameters were cut (`_adopt_state`), check the
  state has this rank's shard shapes (`check_state`), flush level 1; after the step mark the
  leaves stale (levels 1-2) or drop them (level 3, and unsharded parameters' views).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise.communication import recorder
from shardwise.communication._buckets import all_gather_bucket, reduce_scatter_bucket
from shardwise.communication._collectives import (
    Pending,
    ReduceOp,
    all_reduce_,
    all_reduce_async,
)
from shardwise.communication._pairwise import coalesced
from shardwise.layout import DeviceMatrix
from shardwise.optim._groups import BucketGroups, bucket_groups
from shardwise.optim._plan import Bucket, OptimizerPlan, ParamShard
from shardwise.redistribution import local_block

_Token = tuple[str, str]


class OptimizerParallel:
    """Run `plan` for `network` on this rank (see the module docstring).

    Args:
        network: the network (its parameters already cut to their op-level blocks).
        plan: the optimizer plan.
        matrix: the op-level plan's global device matrix.
    """

    def __init__(self, network: nn.Module, plan: OptimizerPlan, matrix: DeviceMatrix) -> None:
        self.plan = plan
        self.level = plan.config.optimizer_level
        self.world = comm.get_group_size()
        self.params = {s.info.name: network.get_parameter(s.info.name) for s in plan.params}
        self.shards = {s.info.name: s for s in plan.params}
        self.bucket_of = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
        self.by_id = {id(p): n for n, p in self.params.items()}
        # groups in bucket order on every rank (member-only groups must be made in one order)
        self.groups = [bucket_groups(matrix, b.dp_axes, b.shard) for b in plan.buckets]
        self.leaves: dict[str, torch.Tensor] = {}
        self._stale: set[str] = set()  # levels 1-2: leaves kept past the step, refilled in place
        self.ready: dict[int, set[str]] = {}
        self._end_queued = -1  # the backward (graph task id) `_end_backward` is queued for
        self._regathered: dict[int, dict[str, torch.Tensor]] = {}
        self._used: dict[str, bool] = {}
        self._gathered_ids: dict[int, str] = {}  # gathered leaves (level 3 saved-tensor hooks)
        self._gathered_ptrs: dict[tuple[int, ...], str] = {}
        self._packed: set[int] = set()  # buckets autograd saved a token of (level 3)
        self._inflight: list[
            tuple[int, str, Pending[list[torch.Tensor]]]
        ] = []  # started reductions
        self._prefetched: dict[int, Pending[list[torch.Tensor]]] = {}  # next buckets' AGs
        self._regathering: dict[int, Pending[list[torch.Tensor]]] = {}  # level 3, backward
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

        self._handles: list[RemovableHandle] = [
            torch_optimizer.register_optimizer_step_pre_hook(before),
            torch_optimizer.register_optimizer_step_post_hook(after),
        ]
        for handle in self._handles:
            weakref.finalize(self, handle.remove)

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
                    piece: Any = p.detach().narrow(0, pos * rows, rows).clone()
                    p.set_(piece)  # keeps the Parameter object (optimizers hold it)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of the parameters this engine manages."""
        return id(t) in self.by_id

    def remove(self) -> None:
        """Remove the global optimizer hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forward ---------------------------------------------------------------------------
    def compute(self, p: torch.Tensor) -> torch.Tensor:
        """The compute leaf of parameter `p` for this step (its whole op-level block)."""
        name = self.by_id[id(p)]
        if self._end_queued != -1 and torch._C._current_graph_task_id() == -1:
            self._drop_unfinished_backward()  # a forward after a backward that raised
        if not self._live(name):
            i = self.bucket_of.get(name)
            if i is not None and self.plan.buckets[i].kind == "shard":
                # levels 1-2 keep every gathered bucket until backward: start them all now (their
                # transfers overlap); level 3 frees them: only this bucket and the next one
                self._prefetch(i, 2 if self.level == "level3" else len(self.plan.buckets))
                self._gather(i)
            else:
                self._leaf(name, p.detach())
        return self.leaves[name]

    def _live(self, name: str) -> bool:
        """Whether parameter `name` has a compute leaf holding this step's weights."""
        return name in self.leaves and name not in self._stale and not self._freed(name)

    def _leaf(self, name: str, value: torch.Tensor) -> None:
        leaf = value.requires_grad_(self.params[name].requires_grad)
        if self.shards[name].sharded:
            self._gathered_ids[id(leaf)] = name
            if leaf._base is not None:  # views of the leaf have the root as their _base
                self._gathered_ids[id(leaf._base)] = name
            self._gathered_ptrs[_storage_key(leaf)] = name
        if leaf.requires_grad:  # (a weak reference: leaves outlive steps, hooks are not traced)
            leaf.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self), name))
        self.leaves[name] = leaf

    def _start_gather(self, i: int) -> Pending[list[torch.Tensor]]:
        """Start one AllGather of bucket `i`'s shards (finished by `_gathered`)."""
        bucket = self.plan.buckets[i]
        outs = None  # levels 1-2 after a step: into last step's leaves (same storage and hooks)
        stale = [n for n in bucket.names if n in self._stale]
        if stale and len(stale) == len(bucket.names):
            outs = [self.leaves[n].detach() for n in bucket.names]  # (shape: the op-level block)
        else:  # (a member had no leaf: new leaves for all)
            for n in stale:
                self._stale.discard(n)
                del self.leaves[n]
        with recorder.label(self._label(i)):
            return all_gather_bucket(
                [self.params[n].detach() for n in bucket.names], self.groups[i].shard, outs
            )

    def _gathered(
        self, i: int, pending: Pending[list[torch.Tensor]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Bucket `i`'s members' whole op-level blocks (one AllGather; `pending`: started)."""
        names = self.plan.buckets[i].names
        gathered = (pending or self._start_gather(i)).wait()
        return {n: g.view(self.shards[n].info.block) for n, g in zip(names, gathered, strict=True)}

    def _label(self, i: int) -> str:
        bucket = self.plan.buckets[i]
        return f"bucket {i} ({', '.join(bucket.names)})"

    def _gather(self, i: int) -> None:
        gathered = self._gathered(i, self._prefetched.pop(i, None))
        for name, full in gathered.items():
            if name in self._stale:  # gathered into the leaf itself (its version bumped)
                self._stale.discard(name)
            elif name in self.leaves:
                self._refill(name, full)
            else:
                self._leaf(name, full)

    def _freed(self, name: str) -> bool:
        """Level 3: whether `end_forward` freed leaf `name` (a second forward before the
        optimizer steps, e.g. gradient accumulation, gathers it again)."""
        leaf = self.leaves.get(name)
        return (
            leaf is not None
            and self.level == "level3"
            and all(part.untyped_storage().size() == 0 for part in comm.rank_parts(leaf))
        )

    def _refill(self, name: str, full: torch.Tensor) -> None:
        """Put the gathered weight back into freed leaf `name`: the same leaf object, so the
        gradients of both forwards accumulate on it."""
        leaf = self.leaves[name]
        for part in comm.rank_parts(leaf):
            dims = zip(part.shape, part.stride(), strict=True)
            last = part.storage_offset() + sum((n - 1) * s for n, s in dims)
            storage = part.untyped_storage()
            storage.resize_(max(storage.size(), int(last + 1) * part.element_size()))
        with torch.no_grad():
            leaf.copy_(full)
        self._gathered_ptrs[_storage_key(leaf)] = name  # (`end_forward` forgot the old one)

    def _prefetch(self, i: int, depth: int) -> None:
        """Start gathering shard bucket `i` and the shard buckets after it, `depth` in all, that
        are neither gathered nor started (each finished at its first use, by `_gather`)."""
        with coalesced():  # started together: one message per peer on gloo
            for j in range(i, len(self.plan.buckets)):
                bucket = self.plan.buckets[j]
                if bucket.kind != "shard":
                    continue
                if not self._live(bucket.names[0]) and j not in self._prefetched:
                    self._prefetched[j] = self._start_gather(j)
                depth -= 1
                if depth == 0:
                    return

    @contextmanager
    def saved_tensors(self) -> Iterator[None]:
        """Level 3: while the network runs forward, autograd saves a token for a gathered
        weight instead of the weight (gathered again in backward by `_unpack`)."""
        if self.level != "level3":
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        """A token for a gathered weight or a view of one (e.g. ``weight.t()`` saved by
        ``linear``): found by identity, view base, or storage."""
        base = t._base if t._base is not None else t
        name = self._gathered_ids.get(id(base))
        if name is None:
            name = self._gathered_ptrs.get(_storage_key(t))
        if name is None:
            return t
        leaf = self.leaves[name]
        offset = t.storage_offset() - leaf.storage_offset()
        view = None if t is leaf else (tuple(t.size()), tuple(t.stride()), offset)
        self._packed.add(self.bucket_of[name])
        return ("hsdp", name, view)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not (isinstance(saved, tuple) and len(saved) == 3 and saved[0] == "hsdp"):
            return saved  # type: ignore[no-any-return]
        _, name, view = saved
        i = self.bucket_of[name]
        if i not in self._regathered:
            self._queue_end()
            self._start_regather(i)
            # backward runs the layers in reverse: start gathering the previous saved bucket too
            earlier = [j for j in self._packed if j < i and j not in self._regathered]
            if earlier:
                self._start_regather(max(earlier))
            pending = self._regathering.pop(i)
            self._regathered[i] = {n: t.contiguous() for n, t in self._gathered(i, pending).items()}
        full = self._regathered[i][name]
        return full if view is None else full.as_strided(*view)

    def _start_regather(self, i: int) -> None:
        if i not in self._regathering:
            with recorder.phase("backward"):
                self._regathering[i] = self._start_gather(i)

    def end_forward(self) -> None:
        """Level 3: free the gathered weights now that the forward is done."""
        if self.level != "level3":
            return
        for name, leaf in self.leaves.items():
            if self.shards[name].sharded:
                for part in comm.rank_parts(leaf):
                    part.untyped_storage().resize_(0)
        # the allocator may hand those addresses to the next forward's activations
        self._gathered_ptrs.clear()

    # -- backward --------------------------------------------------------------------------
    def _queue_end(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._end_queued == task:
            return
        recorder.mark("backward: first gradient ready")
        self._end_queued = task
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _drop_unfinished_backward(self) -> None:
        """Forget what a backward that raised left (called by the next forward): its started
        collectives are finished (every rank posted them) and their results dropped, its
        partial buckets and backward re-gathers forgotten (the weights may have changed since)
        and, at levels 2-3, the gradients its leaves got (level 1's leaves accumulate the
        step's earlier backward calls too: kept)."""
        for pending in [*self._regathering.values(), *(p for _, _, p in self._inflight)]:
            pending.wait()
        self._end_queued = -1
        self._regathering.clear()
        self._regathered.clear()
        self._inflight.clear()
        self.ready.clear()
        if self.level != "level1":
            for leaf in self.leaves.values():
                leaf.grad = None

    def _on_grad(self, name: str) -> None:
        self._queue_end()
        i = self.bucket_of[name]
        bucket = self.plan.buckets[i]
        if bucket.kind == "shard" and self.level == "level1":
            return  # full gradients kept on the leaves until the optimizer steps
        done = self.ready.setdefault(i, set())
        done.add(name)
        # (a member without a leaf this step, unused, does not hold the bucket back)
        if all(n in done or n not in self.leaves or n in self._stale for n in bucket.names):
            self._reduce(i)

    def _end_backward(self) -> None:
        """Reduce buckets whose used members all have gradients but some member is unused."""
        self._end_queued = -1
        for pending in self._regathering.values():  # (started, but no saved weight needed it)
            pending.wait()
        self._regathering.clear()
        self._regathered.clear()
        self._packed.clear()
        for i in sorted(self.ready):
            if self.ready[i]:
                self._reduce(i)
        self._drain()
        recorder.mark("backward done")

    def flush(self) -> None:
        """Reduce every bucket with pending gradients (level 1: at the optimizer's step)."""
        with coalesced():  # all started before any is waited for: one message per peer
            for i, bucket in enumerate(self.plan.buckets):
                leaves = [self.leaves.get(n) for n in bucket.names]
                if any(leaf is not None and leaf.grad is not None for leaf in leaves):
                    self._reduce(i, phase="step")
        self._drain()

    def _reduce(self, i: int, phase: str = "backward") -> None:
        """Start reducing bucket `i`'s gradients (finished by `_drain`: at the end of backward,
        or at once for level 1's reduction at the optimizer step)."""
        bucket, groups = self.plan.buckets[i], self.groups[i]
        self.ready.pop(i, None)
        grads = self._grads(bucket)
        if grads is None:
            return
        with recorder.phase(phase), recorder.label(self._label(i)), torch.no_grad():
            if bucket.kind == "shard":
                pending = reduce_scatter_bucket(grads, ReduceOp.SUM, groups.shard)
                self._inflight.append((i, phase, pending))
                return
            # (one member: reduced in place in its gradient, which the leaf no longer holds)
            flat = (
                grads[0].reshape(-1)
                if len(grads) == 1
                else torch.cat([g.reshape(-1) for g in grads])
            )
            if groups.copies_size > 1:
                started = all_reduce_async(flat, ReduceOp.SUM, groups.copies)
                self._inflight.append((i, phase, Pending(lambda: [started.wait()])))
            else:
                self._finish(i, [flat])

    def _finish(self, i: int, parts: list[torch.Tensor]) -> None:
        """A shard bucket's AllReduce over the copy group (an all-reduce bucket's AllReduce
        already was that), / world size, into ``param.grad`` (`parts`: one reduced tensor per
        member, or one flat buffer of them)."""
        groups, bucket = self.groups[i], self.plan.buckets[i]
        if bucket.kind == "shard" and groups.copies_size > 1:
            flat = parts[0].view(-1) if len(parts) == 1 else torch.cat([p.view(-1) for p in parts])
            all_reduce_(flat, ReduceOp.SUM, groups.copies)
            parts = [flat]
        if len(parts) != len(bucket.names):
            sizes = [math.prod(self._shape(n, bucket)) for n in bucket.names]
            parts = list(parts[0].split(sizes))
        for n, part in zip(bucket.names, parts, strict=True):
            self._deposit(n, bucket, part.div_(self.world))

    def _drain(self) -> None:
        """Finish the started reductions, in the order they started."""
        inflight, self._inflight = self._inflight, []
        for i, phase, pending in inflight:
            with recorder.phase(phase), recorder.label(self._label(i)), torch.no_grad():
                self._finish(i, pending.wait())

    def _grads(self, bucket: Bucket) -> list[torch.Tensor] | None:
        """The members' leaf gradients (zeros for a member without one); None: none has one."""
        leaves = [self.leaves.get(n) for n in bucket.names]
        if not any(leaf is not None and leaf.grad is not None for leaf in leaves):
            return None
        out = []
        for n, leaf in zip(bucket.names, leaves, strict=True):
            grad = None if leaf is None else leaf.grad
            out.append(grad if grad is not None else self._zeros(n))
            self._used[n] = grad is not None
            if leaf is not None:
                leaf.grad = None
        return out

    def _zeros(self, name: str) -> torch.Tensor:
        p, shard = self.params[name], self.shards[name]
        return torch.zeros(shard.info.block, dtype=p.dtype, device=p.device)

    def _deposit(self, name: str, bucket: Bucket, grad: torch.Tensor) -> None:
        """Add a reduced gradient (a fresh tensor) to parameter `name`'s ``.grad``."""
        p = self.params[name]
        if self._used.get(name, True):  # an unused parameter keeps grad None, as on one device
            g = grad.view(self._shape(name, bucket))
            p.grad = g if p.grad is None else p.grad + g

    def _shape(self, name: str, bucket: Bucket) -> tuple[int, ...]:
        """Parameter `name`'s stored shape: its shard or (unsharded) its op-level block."""
        shard = self.shards[name]
        return tuple(shard.shard_shape if bucket.kind == "shard" else shard.info.block)

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
        recorder.mark("optimizer step")
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
                    value = value.narrow(0, pos * rows, rows)
                state[key] = value.clone()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mine(optimizer):  # the shards changed: gather again at the next forward
            if self.level == "level3":
                self.leaves.clear()
            else:  # sharded members: refilled in place; the others (views of the parameter): new
                self._stale = {n for n in self.leaves if self.shards[n].sharded}
                self.leaves = {n: leaf for n, leaf in self.leaves.items() if n in self._stale}
            self._gathered_ids.clear()
            self._gathered_ptrs.clear()


def _storage_key(t: torch.Tensor) -> tuple[int, ...]:
    """Where `t`'s data lives: the storage address of each rank's part (views share it)."""
    return tuple(part.untyped_storage().data_ptr() for part in comm.rank_parts(t))


def check_state(name: str, p: torch.Tensor, state: dict[str, Any]) -> None:
    """Raise ValueError when optimizer state does not have this rank's shape of `p` (e.g.
    loaded from a checkpoint saved with another shard layout)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
            raise ValueError(
                f"optimizer state {key!r} of parameter {name!r} has shape {list(value.shape)} "
                f"but this rank holds a shard of shape {list(p.shape)}: the state was saved "
                f"with another optimizer-parallel layout (hsdp shard size / level or device "
                f"count); load a checkpoint saved under the same layout"
            )


GradHook = Callable[[torch.Tensor], None]


def _grad_hook(engine: weakref.ref[OptimizerParallel], name: str) -> GradHook:
    """Leaf `name`'s post-accumulate-grad hook: the engine's `_on_grad` (while it lives)."""

    def hook(leaf: torch.Tensor) -> None:
        alive = engine()
        if alive is not None:
            alive._on_grad(name)

    return hook


__all__ = ["BucketGroups", "OptimizerParallel", "ParamShard", "check_state"]
