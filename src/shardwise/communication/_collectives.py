"""The collectives themselves: plain functions, no autograd, every call recorded.

Each function validates what this rank can check, issues the torch.distributed call (or, in a
simulated world, the one the simulator answers) between `_trace.enter` and `_trace.leave` (which
collective this rank is in, for the launcher's hang report), and reports a `CommRecord`
(`_record` / `record_sized`; a started call through `deferred_record`):

- `all_reduce` (and in place: `all_reduce_`), `all_gather` (concat on dim 0),
  `reduce_scatter` (split on dim 0), and `all_reduce_async` / `all_gather_async` /
  `reduce_scatter_async` (started now by `_start_all_reduce` / `_start_all_gather` /
  `_start_reduce_scatter`, finished by `Pending.wait`: computation goes on meanwhile; simulated
  worlds finish at once);
- `broadcast`, `reduce` (to one rank, used by Broadcast's gradient; in a simulated world
  `_sim_rooted`), `all_to_all`;
- `check_member`: a root or peer rank must be in the group.

Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, `reduce_scatter` and `all_to_all` first compare the
ranks' shapes and dtypes (`_fingerprint.check_alike`): torch's checking process groups compare
those of the other collectives, not of the all-to-all both run on.

In a simulated world a plain tensor (made from Python data in the step, or outside the world:
one value every rank holds) enters a collective as every rank's copy (`_sim.every_rank`; an
in-place all-reduce writes the result back into it: `_copy_back`): torch's simulated
collectives left it as it was.

The reductions are `ReduceOp` (`shardwise.communication._reduce_op`, re-exported here);
point-to-point `exchange` is in `shardwise.communication._exchange`.

Gloo's own reduce-scatter is an all-reduce followed by a copy, 2(N-1)/N bytes per rank;
`reduce_scatter` on gloo instead sends each rank its chunk with one all-to-all and reduces the
N received chunks locally, the (N-1)/N bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from shardwise.communication import _fingerprint, _sim, _trace, recorder
from shardwise.communication._init import Group, resolve_group
from shardwise.communication._reduce_op import ReduceOp as ReduceOp
from shardwise.communication._reduce_op import as_reduce_op as as_reduce_op

T = TypeVar("T")


def _record(kind: str, g: Group, t: torch.Tensor, start: float) -> None:
    """Report one call of `kind` on input `t` (nothing happens unless a recorder is active)."""
    record_sized(kind, g, t.dtype, t.numel(), start)


def record_sized(kind: str, g: Group, dtype: torch.dtype, numel: int, start: float) -> None:
    """Report one call of `kind` on an input of `numel` elements of `dtype` (priced with
    `bytes_bound`; nothing happens unless a recorder is active)."""
    if not recorder.recording():
        return
    nbytes = recorder.bytes_bound(kind, numel * dtype.itemsize, len(g.ranks))
    recorder.record(kind, g.ranks, dtype, numel, nbytes, recorder.timer() - start)


def _check_same_shape(what: str, t: torch.Tensor) -> None:
    """In a simulated world, every rank must bring the same shape (real runs would hang)."""
    sim = _sim.current()
    if sim is None:
        return
    shapes = [tuple(p.shape) for p in sim.local_tensors(t)]
    if len(set(shapes)) > 1:
        detail = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
        raise ValueError(f"{what}: every rank must pass the same input shape; got {detail}")


def _check_dim0(what: str, t: torch.Tensor, n: int) -> None:
    if t.dim() == 0 or t.shape[0] % n != 0:
        dim0 = "a 0-d tensor" if t.dim() == 0 else f"dim 0 of size {t.shape[0]}"
        raise ValueError(
            f"{what}: input has {dim0}, which does not divide into {n} ranks of the group; "
            f"make dim 0 a multiple of {n}"
        )


def _is_gloo(g: Group) -> bool:
    if _sim.current() is not None:
        return True
    return dist.get_backend(g.pg) == "gloo"


def all_reduce(t: torch.Tensor, op: ReduceOp, group: str | Group | None) -> torch.Tensor:
    """Reduce `t` over the group; every rank gets the result (a new tensor)."""
    return all_reduce_(t.detach().clone(memory_format=torch.contiguous_format), op, group)


def all_reduce_(t: torch.Tensor, op: ReduceOp, group: str | Group | None) -> torch.Tensor:
    """Reduce contiguous `t` over the group in place (no copy); returns `t`."""
    return _start_all_reduce(t, op, group, async_op=False).wait()


def all_reduce_async(
    t: torch.Tensor, op: ReduceOp, group: str | Group | None
) -> Pending[torch.Tensor]:
    """`all_reduce_` (in place on contiguous `t`), started now and finished by
    ``Pending.wait()`` (recorded then, with the phase and label current at the start). A
    simulated world runs it at once."""
    return _start_all_reduce(t, op, group, async_op=_sim.current() is None)


class Pending(Generic[T]):
    """A started collective; `wait()` finishes it and returns its result (once)."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None

    def wait(self) -> T:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


def free_now(t: torch.Tensor) -> None:
    """Free the storage of `t`, a finished collective's buffer that nothing else uses, on this
    thread now: gloo's worker thread may hold the finished work, and its tensors, a while longer
    and free them whenever it lets go (at no defined point of the step, and unseen by a
    `report.MemoryMeter`). Only a plain tensor (a simulated world's holds every rank's part)."""
    if type(t) is torch.Tensor:
        t.untyped_storage().resize_(0)


def _started(
    kind: str,
    g: Group,
    t: torch.Tensor,
    start: float,
    work: Any,
    result: Callable[[], torch.Tensor],
    token: _trace.Token = None,
) -> Pending[torch.Tensor]:
    """A `Pending` that waits for `work` (None: already done), computes the result and records
    the call under the phase and label current now (its start); `token`: its `_trace.enter`."""
    done = deferred_record(kind, g, t.dtype, t.numel(), start)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        _trace.leave(token)
        out = result()
        done()
        return out

    return Pending(finish)


def deferred_record(
    kind: str, g: Group, dtype: torch.dtype, numel: int, start: float
) -> Callable[[], None]:
    """For a call started at `start` and finished later: a function that records it (as
    `record_sized`) under the phase and label current now, at its start."""
    phase, label = recorder.current()

    def done() -> None:
        with recorder.phase(phase), recorder.label(label):
            record_sized(kind, g, dtype, numel, start)

    return done


def _copy_back(t: torch.Tensor, per_rank: torch.Tensor) -> torch.Tensor:
    """`t`, a plain tensor of a simulated world, holding `per_rank`'s value (the same on every
    rank after the reduction); `t` itself when it is `per_rank`."""
    if per_rank is not t:
        sim = _sim.current()
        assert sim is not None
        with _sim.plain_tensors():
            t.copy_(sim.local_tensors(per_rank)[0])
    return t


def _start_all_reduce(
    t: torch.Tensor, op: ReduceOp, group: str | Group | None, async_op: bool
) -> Pending[torch.Tensor]:
    g = resolve_group(group)
    _check_same_shape("AllReduce", t)
    start = recorder.start()
    token = _trace.enter("AllReduce", g)
    each = _sim.every_rank(t, copies=True)  # (a simulated world's plain tensor: every rank's)
    work = dist.all_reduce(each, op=op.torch_op(), group=g.pg, async_op=async_op)
    return _started("AllReduce", g, t, start, work, lambda: _copy_back(t, each), token)


def _start_all_gather(
    t: torch.Tensor, group: str | Group | None, async_op: bool, out: torch.Tensor | None = None
) -> Pending[torch.Tensor]:
    """`out`: a contiguous tensor of the result's shape to gather into (None: a new one)."""
    g = resolve_group(group)
    if t.dim() == 0:
        raise ValueError("AllGather: input must have at least one dimension (concat on dim 0)")
    _check_same_shape("AllGather", t)
    start = recorder.start()
    src = _sim.every_rank(t.detach().contiguous())
    if out is None:
        out = src.new_empty((len(g.ranks) * src.shape[0], *src.shape[1:]))
    token = _trace.enter("AllGather", g)
    work = dist.all_gather_single(out, src, group=g.pg, async_op=async_op)
    return _started("AllGather", g, t, start, work, lambda: out, token)


def _start_reduce_scatter(
    t: torch.Tensor, op: ReduceOp, group: str | Group | None, async_op: bool
) -> Pending[torch.Tensor]:
    g = resolve_group(group)
    n = len(g.ranks)
    _check_same_shape("ReduceScatter", t)  # (first: a per-rank dim 0 named as such)
    _fingerprint.check_alike("ReduceScatter", t, g)  # (DETAIL only; also first)
    _check_dim0("ReduceScatter", t, n)
    start = recorder.start()
    src = _sim.every_rank(t.detach().contiguous())
    token = _trace.enter("ReduceScatter", g)
    if _is_gloo(g):
        # all-to-all moves only the chunks other ranks own: (N-1)/N of the input per rank.
        received = torch.empty_like(src)
        work = dist.all_to_all_single(received, src, group=g.pg, async_op=async_op)

        def reduced() -> torch.Tensor:
            out = op.reduce(received.view(n, src.shape[0] // n, *src.shape[1:]), 0)
            free_now(received)
            return out

        return _started("ReduceScatter", g, t, start, work, reduced, token)
    out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
    work = dist.reduce_scatter_single(out, src, op=op.torch_op(), group=g.pg, async_op=async_op)
    return _started("ReduceScatter", g, t, start, work, lambda: out, token)


def all_gather(t: torch.Tensor, group: str | Group | None) -> torch.Tensor:
    """Concatenate every rank's `t` along dim 0, in group-rank order."""
    return _start_all_gather(t, group, async_op=False).wait()


def reduce_scatter(t: torch.Tensor, op: ReduceOp, group: str | Group | None) -> torch.Tensor:
    """Reduce `t` over the group and give rank i the i-th chunk of dim 0."""
    return _start_reduce_scatter(t, op, group, async_op=False).wait()


def all_gather_async(t: torch.Tensor, group: str | Group | None) -> Pending[torch.Tensor]:
    """`all_gather`, started now and finished by ``Pending.wait()`` (recorded then, with the
    phase and label current at the start). A simulated world runs it at once."""
    return _start_all_gather(t, group, async_op=_sim.current() is None)


def reduce_scatter_async(
    t: torch.Tensor, op: ReduceOp, group: str | Group | None
) -> Pending[torch.Tensor]:
    """`reduce_scatter`, started now and finished by ``Pending.wait()`` (recorded then, with the
    phase and label current at the start). A simulated world runs it at once."""
    return _start_reduce_scatter(t, op, group, async_op=_sim.current() is None)


def check_member(what: str, rank: int, g: Group, arg: str) -> None:
    """Raise a ValueError naming `arg` when global `rank` is not in the group."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in g.ranks:
        raise ValueError(f"{what}: {arg}={rank!r} is not a rank of group {g}")


def _sim_rooted(t: torch.Tensor, root: int, g: Group, reduce: bool) -> torch.Tensor:
    """Broadcast / reduce-to-root in a simulated world, on every translate of the group.

    (LocalTensorMode has no reduce, and its broadcast misplaces the root of sub-groups.)
    """
    sim = _sim.current()
    assert sim is not None
    parts = [p.detach() for p in sim.local_tensors(t)]
    index = g.ranks.index(root)
    out = list(parts)
    for tile in sim.tiles(g.ranks):
        src = tile[index]
        total = torch.stack([parts[r] for r in tile]).sum(0) if reduce else parts[src]
        for r in tile:
            out[r] = total.clone() if r == src or not reduce else torch.zeros_like(total)
    return sim.from_local_tensors(out)


def broadcast(t: torch.Tensor, root: int, group: str | Group | None) -> torch.Tensor:
    """Every rank gets the `root` rank's `t` (`root` is a global rank in the group)."""
    g = resolve_group(group)
    check_member("Broadcast", root, g, "root_rank")
    _check_same_shape("Broadcast", t)
    start = recorder.start()
    if _sim.current() is not None:
        out = _sim_rooted(t, root, g, reduce=False)
    else:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        token = _trace.enter("Broadcast", g)
        dist.broadcast(out, src=root, group=g.pg)
        _trace.leave(token)
    _record("Broadcast", g, t, start)
    return out


def reduce(t: torch.Tensor, root: int, group: str | Group | None) -> torch.Tensor:
    """Sum `t` onto the `root` rank; the other ranks get zeros."""
    g = resolve_group(group)
    check_member("Reduce", root, g, "root_rank")
    start = recorder.start()
    if _sim.current() is not None:
        out = _sim_rooted(t, root, g, reduce=True)
    else:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        token = _trace.enter("Reduce", g)
        dist.reduce(out, dst=root, group=g.pg)
        _trace.leave(token)
        if dist.get_rank() != root:
            out.zero_()
    _record("Reduce", g, t, start)
    return out


def _check_split(t: torch.Tensor, split_dim: int, concat_dim: int, n: int) -> None:
    nd = t.dim()
    for name, d in (("split_dim", split_dim), ("concat_dim", concat_dim)):
        if not -nd <= d < nd:
            raise ValueError(f"AlltoAll: {name}={d} is out of range for a {nd}-d input")
    size = t.shape[split_dim]
    if size % n != 0:
        raise ValueError(
            f"AlltoAll: input dim {split_dim} (split_dim) has size {size}, "
            f"which does not divide by split_count={n}"
        )


def all_to_all(
    t: torch.Tensor, split_dim: int, concat_dim: int, group: str | Group | None
) -> torch.Tensor:
    """Split `t` on `split_dim` into N chunks, send chunk i to rank i, concat on `concat_dim`."""
    g = resolve_group(group)
    n = len(g.ranks)
    _check_same_shape("AlltoAll", t)
    _fingerprint.check_alike("AlltoAll", t, g)  # (DETAIL only; before the per-rank checks)
    _check_split(t, split_dim, concat_dim, n)
    start = recorder.start()
    src = _sim.every_rank(t.detach())
    # chunk i of split_dim goes to rank i: on dim 0 the tensor already is that buffer
    if split_dim % src.dim() == 0:
        send = src.contiguous()
    else:
        send = torch.stack(src.chunk(n, dim=split_dim), 0).contiguous()
    received = torch.empty_like(send)
    token = _trace.enter("AlltoAll", g)
    dist.all_to_all_single(received, send, group=g.pg)
    _trace.leave(token)
    split0, concat0 = split_dim % src.dim() == 0, concat_dim % src.dim() == 0
    if concat0:  # the received chunks, in rank order, already are the concatenation
        out = received if split0 else received.flatten(0, 1)
    else:
        out = torch.cat(received.chunk(n, 0) if split0 else received.unbind(0), dim=concat_dim)
    _record("AlltoAll", g, t, start)
    return out
