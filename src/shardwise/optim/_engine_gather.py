"""Optimizer parallel at run time, forward: the compute leaves, gathered from the shards
(`WeightGathering`, the base of `OptimizerParallel`, whose constructor sets the state below).

- `compute` (forward): the tensor the network computes with, a *compute leaf* per parameter and
  step: for a sharded parameter its op-level block, gathered with one AllGather per bucket
  (`communication._buckets.all_gather_bucket`, `_start_gather` / `_gathered` / `_gather`) on
  first use, for the others a view of the parameter (`_leaf`). Leaves are reused until the
  optimizer steps; at levels 1-2 a sharded one is kept past the step (`_stale`) and the next
  gather writes into it in place (same tensor, storage and hook: no new buffer per step; its
  version moves, so autograd refuses a graph kept from before, as for a weight updated in place
  on one device); a shard changed in place otherwise (its version moved: ``load_state_dict``, a
  hand-written update) is gathered again the same way. A leaf takes its parameter's
  ``requires_grad`` at each use (`_trainable`): one made before a ``requires_grad_`` (kept past
  the step, by a ``torch.no_grad()`` evaluation since, or by the step's earlier forward) is
  frozen or unfrozen in place, as the parameter is on one device. Prefetch (`_prefetch`): at
  levels 1-2 the first use of a shard bucket starts every shard bucket's gather (all are kept until
  backward anyway); level 3 starts the bucket in use and the next one. Gathers started
  together are coalesced (`communication._pairwise.coalesced`: on gloo one message per peer
  instead of one per bucket; still one recorded AllGather per bucket). A call under
  ``torch.inference_mode()`` makes them outside it (`_normal_tensors`): they are reused by
  the training calls after it, which cannot save or refill inference tensors.
- Level 3 (`saved_tensors`, `end_forward`): the gathered weights are not kept for backward:
  autograd saves a token instead (saved-tensor hooks, `_pack`) and `_unpack` gathers the bucket
  again in backward (`_start_regather`), starting the previous saved bucket's gather too
  (prefetch: backward runs the layers in reverse; the two coalesced, as in the forward: on
  gloo pairwise messages, whose buffers this thread frees, where a gloo collective's are freed
  whenever its worker thread lets go of them); the leaves' storage is freed after the forward
  (`communication.rank_parts`: the storage of every rank this process runs), and a second
  forward before the optimizer steps (gradient accumulation) gathers it again into the same
  leaves (`_freed`, `_refill`).

The gradient side (`_on_grad`, `_queue_end`, `_drop_unfinished_backward`) is `GradReduction`
(``_engine_reduce``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardwise import communication as comm
from shardwise._torch.autograd_engine import current_graph_task_id
from shardwise._torch.storage import version, view_base
from shardwise.communication import recorder
from shardwise.communication._buckets import all_gather_bucket
from shardwise.communication._collectives import Pending
from shardwise.communication._pairwise import coalesced
from shardwise.optim._engine_reduce import GradReduction, divide_hook, grad_hook


class WeightGathering(GradReduction):
    """The forward half of `OptimizerParallel` (see the module docstring); the attributes are
    set by `OptimizerParallel.__init__`."""

    by_id: dict[int, str]
    _gathered_ids: dict[int, str]
    _gathered_ptrs: dict[tuple[int, ...], list[str]]
    _prefetched: dict[int, Pending[list[torch.Tensor]]]
    _versions: dict[str, int]
    _hooked: set[str]
    packing: bool

    def compute(self, p: torch.Tensor) -> torch.Tensor:
        """The compute leaf of parameter `p` for this step (its whole op-level block)."""
        name = self.by_id[id(p)]
        if self._end_queued != -1 and current_graph_task_id() == -1:
            self._drop_unfinished_backward()  # a forward after a backward that raised
        if not self._live(name):
            with _normal_tensors():
                self._make_live(name, p)
        leaf = self.leaves[name]
        if leaf.requires_grad != p.requires_grad:  # frozen or unfrozen since the leaf was made
            self._trainable(name, leaf)
        return leaf

    def _make_live(self, name: str, p: torch.Tensor) -> None:
        i = self.bucket_of.get(name)
        if i is not None and self._recomputing(i):
            pass  # (a checkpointed region replayed in backward: its weights again, once)
        elif i is not None and self.plan.buckets[i].kind == "shard":
            # levels 1-2 keep every gathered bucket until backward: start them all now (their
            # transfers overlap); level 3 frees them: only this bucket and the next one
            self._prefetch(i, 2 if self.level == "level3" else len(self.plan.buckets))
            self._gather(i)
        else:
            self._leaf(name, p.detach())

    def fill_for_replay(self, names: Iterable[str]) -> None:
        """Level 3, in backward: fill the freed weights `names` that a checkpointed region's
        recomputation reads, before it runs (it may run under torch's selective-checkpoint
        mode, which refuses ops its forward did not run: the gather's copies)."""
        for name in names:
            i = self.bucket_of.get(name)
            if i is not None and not self._live(name):
                self._recomputing(i)

    def _recomputing(self, i: int) -> bool:
        """Level 3, in backward (an activation-checkpointed region's recomputation asks for
        weights `end_forward` freed): bucket `i`'s leaves filled again, from the bucket's
        backward re-gather when `_unpack` made one, else from a gather of their own, which a
        later `_unpack` of the bucket then reads (`_refilled`); True when done."""
        if self.level != "level3" or current_graph_task_id() == -1:
            return False
        names = self.plan.buckets[i].names
        if i not in self._regathered:
            self._queue_end()  # (`_end_backward` frees them again)
            with recorder.phase("backward"):
                self._regathered[i] = self._gathered(i, self._regathering.pop(i, None))
        for n, full in self._regathered[i].items():
            if n in self.leaves and self._freed(n):
                self._refill(n, full)
        # (`_unpack` reads the leaves from now on: the gathered copies are not kept twice)
        self._regathered[i] = {
            n: self.leaves[n].detach() if n in self.leaves else full
            for n, full in self._regathered[i].items()
        }
        self._refilled.update(n for n in names if n in self.leaves)
        return True

    def _live(self, name: str) -> bool:
        """Whether parameter `name` has a compute leaf holding this step's weights. A shard
        changed in place since its gather, not by an optimizer step (``load_state_dict``, a
        hand-written update, ``p.mul_``) marks its leaf stale: gathered again into it."""
        if name not in self.leaves or name in self._stale or self._freed(name):
            return False
        if self._versions.get(name, -1) not in (-1, version(self.params[name])):
            self._stale.add(name)
            return False
        return True

    def _leaf(self, name: str, leaf: torch.Tensor) -> None:
        if self.shards[name].sharded:
            self._gathered_ids[id(leaf)] = name
            root = view_base(leaf)
            if root is not None:  # views of the leaf have the root as their base
                self._gathered_ids[id(root)] = name
            self._gathered_ptrs.setdefault(_storage_key(leaf), []).append(name)
        self._hooked.discard(name)
        self._trainable(name, leaf)
        self.leaves[name] = leaf

    def _trainable(self, name: str, leaf: torch.Tensor) -> None:
        """Give leaf `name` its parameter's ``requires_grad``, and the gradient hook when it
        first requires one. Set on the leaf itself, at every use (`compute`): a leaf made
        before a ``requires_grad_`` is reused, its data, storage and held gradient with it
        (level 1 keeps the full gradients of the step's earlier backward calls on the leaves:
        a parameter frozen since keeps them, as on one device)."""
        leaf.requires_grad_(self.params[name].requires_grad)
        if leaf.requires_grad and name not in self._hooked:
            # (a weak reference: leaves outlive steps, hooks are not traced)
            leaf.register_post_accumulate_grad_hook(grad_hook(weakref.ref(self), name))
            if self.level == "level1":  # (held until the step: divided by its backward's now)
                leaf.register_hook(divide_hook(weakref.ref(self)))
            self._hooked.add(name)

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

    def _gather(self, i: int) -> None:
        gathered = self._gathered(i, self._prefetched.pop(i, None))
        for name, full in gathered.items():
            self._versions[name] = version(self.params[name])
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
        # (`end_forward` forgot the old one)
        self._gathered_ptrs.setdefault(_storage_key(leaf), []).append(name)

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
        """Level 3, around a whole wrapped call: while the network runs forward (`packing`,
        set at the plan's first op and cleared at its last), autograd saves a token for a
        gathered weight instead of the weight (gathered again in backward by `_unpack`). The
        hooks are pushed before the call, not at the plan's first op: that op may run inside
        an activation-checkpointed region, whose own hooks would then be popped in place of
        these at the region's end (and stay on for the rest of the forward)."""
        if self.level != "level3":
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.packing = False

    def _pack(self, t: torch.Tensor) -> Any:
        """A token for a gathered weight or a view of one (e.g. ``weight.t()`` saved by
        ``linear``): found by identity, view base, or storage."""
        if not self.packing:
            return t
        base = view_base(t)
        if base is None:
            base = t
        name = self._gathered_ids.get(id(base))
        if name is None:
            name = self._member_at(t)
        if name is None:
            return t
        leaf = self.leaves[name]
        offset = t.storage_offset() - leaf.storage_offset()
        view = None if t is leaf else (tuple(t.size()), tuple(t.stride()), offset)
        self._packed.add(self.bucket_of[name])
        return ("hsdp", name, view)

    def _member_at(self, t: torch.Tensor) -> str | None:
        """The gathered leaf whose storage `t` lies in (the members of a bucket share one
        buffer: the one whose elements hold `t`'s first)."""
        for name in self._gathered_ptrs.get(_storage_key(t), []):
            leaf = self.leaves[name]
            start = leaf.storage_offset()
            if start <= t.storage_offset() < start + leaf.numel():
                return name
        return None

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not (isinstance(saved, tuple) and len(saved) == 3 and saved[0] == "hsdp"):
            return saved  # type: ignore[no-any-return]
        _, name, view = saved
        i = self.bucket_of[name]
        if i not in self._regathered:
            self._queue_end()
            # backward runs the layers in reverse: start gathering the previous saved bucket too
            earlier = [j for j in self._packed if j < i and j not in self._regathered]
            with coalesced():  # (as in the forward: one message per peer, buffers from the pool)
                self._start_regather(i)
                if earlier:
                    self._start_regather(max(earlier))
            pending = self._regathering.pop(i)
            self._regathered[i] = {n: t.contiguous() for n, t in self._gathered(i, pending).items()}
        full = self._regathered[i][name]
        if view is None:
            return full
        size, stride, offset = view  # (the offset from the leaf's start: from `full`'s)
        return full.as_strided(size, stride, full.storage_offset() + offset)

    def _start_regather(self, i: int) -> None:
        if i not in self._regathering:
            with recorder.phase("backward"):
                self._regathering[i] = self._start_gather(i)

    def end_forward(self, names: Iterable[str] | None = None) -> None:
        """Level 3: free the gathered weights now that the forward is done (`names`: only
        those, refilled for a recomputation: `_recomputing`)."""
        if self.level != "level3":
            return
        for name in self.leaves if names is None else [n for n in names if n in self.leaves]:
            if self.shards[name].sharded:
                for part in comm.rank_parts(self.leaves[name]):
                    part.untyped_storage().resize_(0)
        # the allocator may hand those addresses to the next forward's activations
        self._gathered_ptrs.clear()


@contextmanager
def _normal_tensors() -> Iterator[None]:
    """Outside ``torch.inference_mode()`` for the engine's own tensors: a call run under it
    (an evaluation) would make the leaves, the gather buffers and the views of the parameters
    inference tensors, which a later training call can neither save for backward nor refill
    in place. Grad mode stays off, as inference mode had it."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _storage_key(t: torch.Tensor) -> tuple[int, ...]:
    """Where `t`'s data lives: the storage address of each rank's part (views share it)."""
    return tuple(part.untyped_storage().data_ptr() for part in comm.rank_parts(t))
