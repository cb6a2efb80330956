"""Step 4 without optimizer parallel: the gradients' AllReduces, fused in buckets
(`GradBuckets`, which `_grad_plan.GradPlanning` makes and `_graph_run.GraphRun` keeps).

`GradBuckets` puts hooks on every parameter that sum its partial gradient over the axes on
which the parameter is replicated, one AllReduce per fused bucket of gradients
(`_hsdp.gradient_buckets`: DDP's 25 MB by default), started as soon as the bucket is full
(asynchronous in a real job: it overlaps the rest of backward); each share is divided first by
the running backward's `divisor` (`GraphRun.set_divisor`: 1 after a train step's backward
seeded with 1/N, `_seeds`, whose shares are one device's; N after a wrapped network's, whose
caller seeds every rank's copy, as DDP), so a float16 sum overflows only where one device's
gradient would; a gradient the plan made equal over some replica axes
(`ParallelPlan.equal_grads`) is not summed over them but multiplied by their size (`_times`); a
sparse gradient (``nn.Embedding(sparse=True)``) is summed on its own (`GradBuckets._sparse`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import communication as comm
from shardwise._torch.autograd_engine import (
    current_graph_task_id,
    queue_callback,
    will_engine_execute_node,
)
from shardwise._torch.checkpointing import in_reentrant_backward
from shardwise._torch.storage import storage_use_count
from shardwise.communication import recorder
from shardwise.communication._collectives import Pending, ReduceOp, all_reduce_, all_reduce_async
from shardwise.communication._count_factor import correct_, corrected, forget_factor
from shardwise.communication._sparse import all_reduce_sparse
from shardwise.optim import OptimizerPlan, ParamInfo
from shardwise.parallel._runtime import group_for


class _Bucket:
    """One gradient bucket on this rank: its parameters, their places in one flat buffer, and
    what the running backward put there."""

    def __init__(
        self, label: str, group: str | None, params: Sequence[torch.Tensor], times: list[int]
    ) -> None:
        self.label, self.group, self.params = label, group, params
        self.times = times  # per member: the ranks its gradient is equal on (`_times`)
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.shapes = [p.shape for p in params]
        self.offsets = [sum(self.sizes[:j]) for j in range(len(params))]
        self.stores = [_grad_store(p) for p in params]
        # the flat buffer for stored gradients, reused while no gradient delivered from it
        # is alive (`_finish` makes each member's .grad its slot), and its slots
        self.kept: torch.Tensor | None = None
        self.kept_slots: list[torch.Tensor] = []
        self.kept_refs = 0  # references to its storage of its own (`storage_use_count`)
        # the running backward: its flat buffer, how each member that got a gradient receives
        # the reduced one ("store": its slot becomes .grad, "add": added to .grad, "return":
        # the hook returned its slot), and the started AllReduce
        self.flat: torch.Tensor | None = None
        self.got: dict[int, str] = {}
        self.pending: Pending[torch.Tensor] | None = None
        self.extra: list[tuple[int, torch.Tensor]] = []  # reduced on their own onto a "store"

    def slot(self, j: int) -> torch.Tensor:
        """Member `j`'s place in the flat buffer (in its parameter's shape)."""
        assert self.flat is not None
        if self.flat is self.kept:
            return self.kept_slots[j]
        return self.flat[self.offsets[j] : self.offsets[j] + self.sizes[j]].view(self.shapes[j])

    def buffer(self, g: torch.Tensor, keep: bool) -> torch.Tensor:
        """This backward's flat buffer: the kept one (`keep`: the reduced gradients go to
        ``.grad`` at the end of backward; a new kept one while gradients of the last are still
        referenced) or a new one (its slots are returned to the caller)."""
        if not keep:
            return g.new_empty(self.total)
        if self.kept is None or storage_use_count(self.kept) > self.kept_refs:
            self.kept = g.new_empty(self.total)
            self.kept_slots = [
                self.kept[o : o + n].view(shape)
                for o, n, shape in zip(self.offsets, self.sizes, self.shapes, strict=True)
            ]
            self.kept_refs = storage_use_count(self.kept)
        return self.kept

    def reset(self) -> None:
        self.flat, self.got, self.pending, self.extra = None, {}, None, []


class GradBuckets:
    """Step 4 without optimizer parallel: every gradient summed over the axes its parameter is
    replicated on, in fused buckets (`_hsdp.gradient_buckets`).

    Each parameter's tensor hook writes its gradient divided by `divisor` into
    its slot of the bucket's flat buffer as autograd produces it; the bucket's one AllReduce
    (`all_reduce_async`, in place on the buffer) starts as soon as every member is in, so in a
    real job it runs while the earlier layers' gradients are computed (a simulated world runs it
    at once). At the end of backward
    (`_finish`, queued with autograd's ``queue_callback``) the buckets that some parameters left
    incomplete start (zeros in the missing slots: every rank runs the same graph), all are
    finished in the order they started and delivered: its slot made
    the parameter's ``.grad`` (a view of the flat buffer, like DDP's
    ``gradient_as_bucket_view``; the hook returned the gradient itself, which autograd stored
    until then; the buffer is reused next backward unless a delivered gradient is still
    referenced), added to an existing ``.grad`` (several backward calls per step: the hook
    returned zeros), or, for ``torch.autograd.grad`` (nothing stored), already in place in the
    slot the hook returned.
    A parameter without a gradient in a backward keeps its ``.grad``. The backward a reentrant
    checkpointed region runs inside the collecting one (``CheckpointFunction.backward``) stores
    its gradients into the same buckets (when the step's first gradient arrives there, that
    backward collects, and the enclosing one's gradients fill the buckets again: each is
    all-reduced twice); any other backward than the collecting one, or a gradient arriving
    twice in one backward, is all-reduced on its own in the hook (`_now`: divided first too), and
    so is a sparse COO gradient (``nn.Embedding(sparse=True)``: `_sparse`, sparse again). A
    backward that raised is dropped at the next forward (`drop_unfinished`): its started
    AllReduces are finished, its partial buckets forgotten; the gradients it stored in an empty
    ``.grad`` stay unreduced (zero them before stepping).
    Every share is multiplied, before its sum, by the factor a mean loss whose backward did not
    wait for its count noted for this backward (`EdgePlan.deferred`, `communication.correct_`).
    """

    def __init__(self, network: nn.Module, plan: OptimizerPlan, divisor: Callable[[], int]) -> None:
        self.world = comm.get_group_size()
        self.divisor = divisor  # (what the running backward's shares are divided by)
        self.buckets: list[_Bucket] = []
        self.started: list[_Bucket] = []  # this backward's started AllReduces, in order
        self.task = -1  # the backward (graph task id) whose gradients the buckets hold
        self.handles: list[RemovableHandle] = []
        for i, b in enumerate(plan.buckets):
            params = [network.get_parameter(n) for n in b.names]
            times = [_times(plan.param(n).info) for n in b.names]
            if not b.dp_axes:  # no replicas to sum over: only * times
                if self.world > 1:
                    self.handles += [
                        p.register_hook(self._scale(t)) for p, t in zip(params, times, strict=True)
                    ]
                continue
            matrix = plan.param(b.names[0]).info.layout.matrix  # (the members' matrix)
            group, _ = group_for(matrix, b.dp_axes)  # (created in bucket order on every rank)
            bucket = _Bucket(f"bucket {i} ({', '.join(b.names)})", group, params, times)
            self.buckets.append(bucket)
            self.handles += [p.register_hook(self._hook(bucket, j)) for j, p in enumerate(params)]

    def _scale(self, times: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def scale(g: torch.Tensor) -> torch.Tensor:
            g = corrected(g, current_graph_task_id())  # (a loss's count factor: `_start`)
            d = self.divisor()
            return g * times / d if times != 1 else (g / d if d != 1 else g)

        return scale

    def _hook(self, bucket: _Bucket, j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        p = bucket.params[j]

        def hook(g: torch.Tensor) -> torch.Tensor:
            task = current_graph_task_id()
            if g.layout != torch.strided:  # (``nn.Embedding(sparse=True)``: sparse again)
                reduced = self._sparse(corrected(g, task), bucket, j)
                joined = task == self.task or self._join(task)
                if joined and bucket.pending is None and j not in bucket.got:
                    bucket.got[j] = "sparse"  # (arrived: its slot is not delivered)
                    if len(bucket.got) == len(bucket.params) and bucket.flat is not None:
                        self._start(bucket, task)
                return reduced
            stores = _stores(bucket.stores[j])
            # (the backward a reentrant checkpointed region runs inside the collecting one
            # stores its gradients into the same buckets: `_finish` delivers them)
            joined = task == self.task or self._join(task) or (stores and in_reentrant_backward())
            if not joined or j in bucket.got or bucket.pending is not None:
                # (a nested backward returning its gradients, a second gradient)
                reduced = self._now(corrected(g, task), bucket.group, bucket.times[j])
                if bucket.got.get(j) == "store":  # added to .grad, which `_finish` overwrites
                    bucket.extra.append((j, reduced))
                return reduced
            if bucket.flat is None:
                bucket.flat = bucket.buffer(g, keep=stores)
            elif not stores and bucket.flat is bucket.kept:  # (not in one graph task)
                return self._now(corrected(g, task), bucket.group, bucket.times[j])
            slot = bucket.slot(j)  # (scaled on the way in: no pass over the bucket later)
            times, d = bucket.times[j], self.divisor()
            if times == 1 and d != 1 and not g.requires_grad:
                torch.div(g, d, out=slot)
            else:  # (a gradient with a graph, ``create_graph=True``: no out= op takes it)
                slot.copy_(g)
                if times != d:
                    with torch.no_grad():
                        slot.mul_(times / d)
            if not stores:
                bucket.got[j], out = "return", slot.view_as(g)
            elif p.grad is None:
                bucket.got[j], out = "store", g
            else:  # autograd adds zeros; the reduced gradient is added at the end
                bucket.got[j], out = "add", g.new_zeros(()).expand_as(g)
            if len(bucket.got) == len(bucket.params):
                self._start(bucket, task)
            return out

        return hook

    def _join(self, task: int) -> bool:
        """Whether the running backward (graph task `task`) is the one the buckets collect (the
        first to deliver a gradient since the last `_finish` queues it at its end)."""
        if self.task == -1:
            self.task = task
            recorder.mark("backward: first gradient ready")
            queue_callback(self._finish)
        return task == self.task

    def _now(self, g: torch.Tensor, group: str | None, times: int) -> torch.Tensor:
        """`g` summed over `group` on its own, each share first multiplied by `times` and
        divided by `divisor` (as a bucket's)."""
        d = self.divisor()
        share = g.detach() * (times / d) if times != 1 else g.detach() / d
        with recorder.phase("backward"):  # a gradient hook: no autograd through this sum
            return all_reduce_(share.contiguous(), ReduceOp.SUM, group)

    def _sparse(self, g: torch.Tensor, bucket: _Bucket, j: int) -> torch.Tensor:
        """A sparse COO gradient summed on its own, sparse again (`all_reduce_sparse`: the
        union of the ranks' rows), each share multiplied by `times` and divided first."""
        if bucket.times[j] != 1:
            g = g * bucket.times[j]
        with recorder.phase("backward"), recorder.label(bucket.label):
            return all_reduce_sparse(g, bucket.group, self.divisor())

    def _start(self, bucket: _Bucket, task: int) -> None:
        """Start the bucket's AllReduce: its shares of backward `task`'s gradients, first
        multiplied by the factor of a loss whose backward did not wait for its count
        (`communication.correct_`; nothing when there is none, or when it is 1)."""
        assert bucket.flat is not None
        for j, how in bucket.got.items():
            if how == "sparse":  # (reduced on its own: nothing of it to send here)
                bucket.slot(j).zero_()
        correct_(bucket.flat, task)
        with recorder.phase("backward"), recorder.label(bucket.label):
            bucket.pending = all_reduce_async(bucket.flat, ReduceOp.SUM, bucket.group)
        self.started.append(bucket)

    def _finish(self) -> None:
        """The end of the backward: start the incomplete buckets, finish all, deliver."""
        task, self.task = self.task, -1
        for bucket in self.buckets:
            if bucket.flat is not None and bucket.pending is None:
                for j in range(len(bucket.params)):
                    if j not in bucket.got:
                        bucket.slot(j).zero_()
                self._start(bucket, task)
        forget_factor(task)
        started, self.started = self.started, []
        with torch.no_grad():
            for bucket in started:
                assert bucket.pending is not None and bucket.flat is not None
                bucket.pending.wait()
                for j, how in bucket.got.items():
                    p, reduced = bucket.params[j], bucket.slot(j).view(bucket.shapes[j])
                    if how in ("return", "sparse"):
                        continue
                    if p.grad is None or how == "store":  # (its slot of the kept buffer)
                        p.grad = reduced
                    else:
                        p.grad.add_(reduced)
                for j, reduced in bucket.extra:
                    grad = bucket.params[j].grad
                    assert grad is not None
                    grad.add_(reduced)
                bucket.reset()
        recorder.mark("backward done")

    def drop_unfinished(self) -> None:
        """Forget a backward that raised (its `_finish` never ran; call at the next forward):
        its started AllReduces are finished (every rank started them) and dropped, its partial
        buckets forgotten. Nothing to do inside a backward, or after one that finished."""
        if self.task == -1 or current_graph_task_id() != -1:
            return
        for bucket in self.started:
            assert bucket.pending is not None
            bucket.pending.wait()
        self.started = []
        for bucket in self.buckets:
            bucket.reset()
        self.task = -1


def _times(info: ParamInfo) -> int:
    """The ranks a parameter's gradient is equal on (`ParamInfo.equal_axes`): what the sum over
    them is, times one rank's gradient."""
    matrix = info.layout.matrix
    return math.prod(matrix.shape[a] for a in info.equal_axes)


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
        return bool(will_engine_execute_node(store))
    except RuntimeError:  # torch refuses leaf nodes inside torch.autograd.grad: nothing stored
        return False
