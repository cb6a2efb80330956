"""Optimizer parallel at run time, backward: each bucket's gradients reduced into the shards
(`GradReduction`, the base of `OptimizerParallel`, whose constructor sets the state below).

- `_on_grad` (backward): each compute leaf's post-accumulate-grad hook (`grad_hook`); when
  every used leaf of a bucket has its gradient, the bucket is reduced (`_reduce`): one
  ReduceScatter over the shard group of the bucket's gradients (`reduce_scatter_bucket`: each
  rank receives its dim-0 chunk of every member), an AllReduce over the copy group when the
  shard group is smaller than the data-parallel group, or one AllReduce for unsharded members;
  each gradient is divided first by the running backward's divisor (`GraphRun.set_divisor`:
  1 after a train step's backward seeded with 1/N, `parallel._seeds`, whose shares are already
  one device's; N after a wrapped network's, whose caller seeds every rank's copy: divided
  before the sums, as DDP does), so a sum of float16 gradients overflows only where one
  device's gradient would, and the result is added to ``param.grad`` (`_finish`,
  `_deposit`). The ReduceScatters are started asynchronously and
  finished (`_drain`) at the end of backward, so they run while the earlier layers' gradients
  are computed. Level 1 keeps the full-size gradients on the leaves and reduces at the
  optimizer's step (`flush`: every bucket started, coalesced, then all finished); levels 2 and
  3 reduce in backward, as soon as a bucket is complete. A bucket left incomplete (unused
  parameters) is reduced at the end of backward (`_end_backward`, queued once per backward,
  graph task, by `_queue_end`).
- `zero_held` (level 1, before an optimizer's or a module's ``zero_grad``): the held full
  gradients of its parameters dropped (their ``.grad`` is None until the step, so torch's
  ``zero_grad`` alone clears nothing), without a collective.
- A backward that raised midway (`_drop_unfinished_backward`, run by the next forward): its
  started collectives are finished and dropped, its partial buckets, re-gathers and (levels
  2-3) leaf gradients forgotten; the end-of-backward callback is queued once per backward
  (graph task), so the next backward still gets one.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise._torch.autograd_engine import current_graph_task_id, queue_callback
from shardwise.communication import recorder
from shardwise.communication._buckets import reduce_scatter_bucket
from shardwise.communication._collectives import (
    Pending,
    ReduceOp,
    all_reduce_,
    all_reduce_async,
)
from shardwise.communication._pairwise import coalesced
from shardwise.optim._groups import BucketGroups
from shardwise.optim._plan import Bucket, OptimizerPlan, ParamShard


class GradReduction:
    """The backward half of `OptimizerParallel` (see the module docstring); the attributes are
    set by `OptimizerParallel.__init__`."""

    plan: OptimizerPlan
    level: str
    world: int
    divisor: Callable[[], int]  # what the running backward's gradients are divided by first
    params: dict[str, nn.Parameter]
    shards: dict[str, ParamShard]
    bucket_of: dict[str, int]
    groups: list[BucketGroups]
    leaves: dict[str, torch.Tensor]
    by_id: dict[int, str]
    _stale: set[str]
    ready: dict[int, set[str]]
    _end_queued: int
    _regathered: dict[int, dict[str, torch.Tensor]]
    _regathering: dict[int, Pending[list[torch.Tensor]]]
    _packed: set[int]
    _refilled: set[str]
    _used: dict[str, bool]
    _inflight: list[tuple[int, str, Pending[list[torch.Tensor]]]]
    reading: bool

    if TYPE_CHECKING:

        def end_forward(self, names: Iterable[str] | None = None) -> None: ...

        def owns(self, t: torch.Tensor) -> bool: ...

    def _label(self, i: int) -> str:
        bucket = self.plan.buckets[i]
        return f"bucket {i} ({', '.join(bucket.names)})"

    def _queue_end(self) -> None:
        task = current_graph_task_id()
        if self._end_queued == task:
            return
        recorder.mark("backward: first gradient ready")
        self._end_queued = task
        queue_callback(self._end_backward)

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
        self._free_refilled()
        self._inflight.clear()
        self.ready.clear()
        if self.level != "level1":
            for leaf in self.leaves.values():
                leaf.grad = None

    def _free_refilled(self) -> None:
        """Level 3: free the leaves a recomputation filled again (`_recomputing`)."""
        if self._refilled:
            self.end_forward(self._refilled)
            self._refilled.clear()

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
        self._free_refilled()
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

    def reduce_for_read(self, t: torch.Tensor) -> None:
        """Level 1, before user code reads ``t.grad`` (``clip_grad_value_``, a gradient's
        norm logged between backward and the step): when `t` is one of the parameters, the
        full gradients held on the leaves are reduced now (`reduce_held`), so the read gets
        the parameter's reduced gradient as at levels 2-3 (it got None: nothing clipped)."""
        if self.reading or not self.owns(t):
            return
        self.reading = True
        try:
            self.reduce_held()
        finally:
            self.reading = False

    def reduce_held(self, reduce: bool = True) -> bool:
        """Level 1: reduce the full gradients the leaves hold now (`flush`) instead of at the
        optimizer's step, which then finds none (gradient clipping needs them reduced);
        whether there were any (with `reduce` False: only whether there are)."""
        if self.level != "level1" or all(leaf.grad is None for leaf in self.leaves.values()):
            return False
        if reduce:
            self.flush()
        return True

    def zero_held(self, owner: torch.optim.Optimizer | nn.Module, set_to_none: bool) -> None:
        """Level 1, before ``owner.zero_grad(set_to_none)``: the full gradients the leaves hold
        for `owner`'s parameters (the optimizer's, or the module's) are dropped, as one
        device's ``zero_grad`` drops its ``.grad`` (their ``.grad`` is None until the step, so
        torch's ``zero_grad`` has nothing to clear: the step reduced them with the later
        backward's); with `set_to_none` False a parameter that held one gets a zero ``.grad``
        (one device's is zeroed). No collective: every rank drops its own."""
        if self.level != "level1" or all(leaf.grad is None for leaf in self.leaves.values()):
            return
        if isinstance(owner, torch.optim.Optimizer):
            params = [p for group in owner.param_groups for p in group["params"]]
        else:
            params = list(owner.parameters())
        self.reading = True  # (its ``.grad`` reads in a wrapped step: nothing reduced)
        try:
            for p in params:
                name = self.by_id.get(id(p))
                leaf = None if name is None else self.leaves.get(name)
                if leaf is None or leaf is p or leaf.grad is None:
                    continue
                leaf.grad = None
                if not set_to_none and p.grad is None:
                    p.grad = torch.zeros_like(p)
        finally:
            self.reading = False

    def _reduce(self, i: int, phase: str = "backward") -> None:
        """Start reducing bucket `i`'s gradients (finished by `_drain`: at the end of backward,
        or at once for level 1's reduction at the optimizer step)."""
        bucket, groups = self.plan.buckets[i], self.groups[i]
        self.ready.pop(i, None)
        grads = self._grads(bucket)
        if grads is None:
            return
        with recorder.phase(phase), recorder.label(self._label(i)), torch.no_grad():
            # (/ divisor before the sum, as DDP: finite wherever one device's is; level 1's
            # leaves divided their gradients in each backward already: `divide_hook`)
            divisor = self.divisor()
            if divisor != 1 and self.level != "level1":
                for g in grads:
                    g.div_(divisor)
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
        already was that) into ``param.grad`` (`parts`: one reduced tensor per member, or one
        flat buffer of them)."""
        groups, bucket = self.groups[i], self.plan.buckets[i]
        if bucket.kind == "shard" and groups.copies_size > 1:
            flat = parts[0].view(-1) if len(parts) == 1 else torch.cat([p.view(-1) for p in parts])
            all_reduce_(flat, ReduceOp.SUM, groups.copies)
            parts = [flat]
        if len(parts) != len(bucket.names):
            sizes = [math.prod(self._shape(n, bucket)) for n in bucket.names]
            parts = list(parts[0].split(sizes))
        for n, part in zip(bucket.names, parts, strict=True):
            self._deposit(n, bucket, part)

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


GradHook = Callable[[torch.Tensor], None]


def divide_hook(engine: weakref.ref[GradReduction]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A level-1 leaf's gradient hook: each backward's gradient divided by that backward's
    divisor before it accumulates on the leaf (the leaves hold them until the optimizer's
    step, when another backward may have set another divisor)."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        alive = engine()
        divisor = 1 if alive is None else alive.divisor()
        return g / divisor if divisor != 1 else g

    return hook


def grad_hook(engine: weakref.ref[GradReduction], name: str) -> GradHook:
    """Leaf `name`'s post-accumulate-grad hook: the engine's `_on_grad` (while it lives)."""

    def hook(leaf: torch.Tensor) -> None:
        if leaf.grad is not None and leaf.grad.layout != torch.strided:
            raise TypeError(
                f"optimizer parallel (hsdp): parameter {name!r} got a {leaf.grad.layout} "
                f"gradient (nn.Embedding(sparse=True)); its shards are reduced from dense "
                f"gradients: build the module with sparse=False, or train without hsdp() "
                f"(semi_auto and data_parallel reduce sparse gradients)"
            )
        alive = engine()
        if alive is not None:
            alive._on_grad(name)

    return hook
