"""The collectives themselves: plain functions, no autograd, every call recorded.

Each function validates what this rank can check, issues the torch.distributed call (or, in a
simulated world, the one the simulator answers) between `_trace.enter` and `_trace.leave` (which
collective this rank is in, for the launcher's hang report; point-to-point `exchange` is not
traced, since only some of a group's ranks take part in it), and reports a `CommRecord`:

- `all_reduce` (and in place: `all_reduce_`), `all_gather` (concat on dim 0),
  `reduce_scatter` (split on dim 0), and `all_reduce_async` / `all_gather_async` /
  `reduce_scatter_async` (started
  now, finished by `Pending.wait`: computation goes on meanwhile; simulated worlds finish at
  once),
  `broadcast`, `reduce` (to one rank, used by Broadcast's gradient), `all_to_all`;
- `exchange`: point-to-point sends/receives (NeighborExchange and its V2 halo form).

Gloo's own reduce-scatter is an all-reduce followed by a copy, 2(N-1)/N bytes per rank;
`reduce_scatter` on gloo instead sends each rank its chunk with one all-to-all and reduces the
N received chunks locally, the (N-1)/N bound.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from shardwise.communication import _sim, _trace, recorder
from shardwise.communication._init import Group, resolve_group

T = TypeVar("T")


class ReduceOp(enum.Enum):
    """Reduction of AllReduce / ReduceScatter, with MindSpore's names."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    def torch_op(self) -> dist.ReduceOp.RedOpType:
        return {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT,
        }[self]

    def reduce(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Reduce `t` along `dim` locally, in index order (deterministic)."""
        return self.reduce_parts(t.unbind(dim))

    def reduce_parts(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Reduce equal-shape `parts` in index order into a new tensor (deterministic; the
        first step writes a fresh result, the later ones update it in place)."""
        if len(parts) == 1:
            return parts[0].clone()
        fns: dict[ReduceOp, Callable[..., torch.Tensor]] = {
            ReduceOp.SUM: torch.add,
            ReduceOp.PROD: torch.mul,
            ReduceOp.MAX: torch.maximum,
            ReduceOp.MIN: torch.minimum,
        }
        fn = fns[self]
        out = fn(parts[0], parts[1])
        for p in parts[2:]:
            fn(out, p, out=out)
        return out


def as_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Accept a `ReduceOp` or its name (``"sum"``, ``"max"``, ...).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        names = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduction; use ReduceOp.{{{names}}}") from None


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _start_all_reduce(
    t: torch.Tensor, op: ReduceOp, group: str | Group | None, async_op: bool
) -> Pending[torch.Tensor]:
    g = resolve_group(group)
    _check_same_shape("AllReduce", t)
    start = recorder.start()
    token = _trace.enter("AllReduce", g)
    work = dist.all_reduce(t, op=op.torch_op(), group=g.pg, async_op=async_op)
    return _started("AllReduce", g, t, start, work, lambda: t, token)


def _start_all_gather(
    t: torch.Tensor, group: str | Group | None, async_op: bool, out: torch.Tensor | None = None
) -> Pending[torch.Tensor]:
    """`out`: a contiguous tensor of the result's shape to gather into (None: a new one)."""
    g = resolve_group(group)
    if t.dim() == 0:
        raise ValueError("AllGather: input must have at least one dimension (concat on dim 0)")
    _check_same_shape("AllGather", t)
    start = recorder.start()
    src = t.detach().contiguous()
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
    _check_dim0("ReduceScatter", t, n)
    _check_same_shape("ReduceScatter", t)
    start = recorder.start()
    src = t.detach().contiguous()
    token = _trace.enter("ReduceScatter", g)
    if _is_gloo(g):
        # all-to-all moves only the chunks other ranks own: (N-1)/N of the input per rank.
        received = torch.empty_like(src)
        work = dist.all_to_all_single(received, src, group=g.pg, async_op=async_op)

        def reduced() -> torch.Tensor:
            return op.reduce(received.view(n, src.shape[0] // n, *src.shape[1:]), 0)

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


def all_to_all(
    t: torch.Tensor, split_dim: int, concat_dim: int, group: str | Group | None
) -> torch.Tensor:
    """Split `t` on `split_dim` into N chunks, send chunk i to rank i, concat on `concat_dim`."""
    g = resolve_group(group)
    n = len(g.ranks)
    _check_same_shape("AlltoAll", t)
    start = recorder.start()
    src = t.detach()
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


def _to_self(
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    outs: Sequence[torch.Tensor],
    recv_from: Sequence[tuple[int, int]],
    me: int,
) -> set[int]:
    """Messages a rank sends to itself, delivered by a local copy (gloo has no pair to itself):
    the receive slots filled, matched with the sends by tag, in order."""
    filled: set[int] = set()
    for x, (dst, tag) in zip(sends, send_to, strict=True):
        if dst != me:
            continue
        for j, (src, rtag) in enumerate(recv_from):
            if src == me and rtag == tag and j not in filled:
                outs[j].copy_(x.detach().reshape(outs[j].shape))
                filled.add(j)
                break
    return filled


def _p2p(
    kind: str,
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    recv_from: Sequence[tuple[int, int]],
    recv_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    g: Group,
) -> tuple[list[torch.Tensor], int]:
    """`exchange` in a real job: (the received tensors, the bytes sent to other ranks)."""
    for peer, _ in [*send_to, *recv_from]:
        if peer != -1:
            check_member(kind, peer, g, "send/recv rank id")
    outs = [
        (torch.zeros if src == -1 else torch.empty)(tuple(s), dtype=dtype, device=device)
        for s, (src, _) in zip(recv_shapes, recv_from, strict=True)
    ]
    me = dist.get_rank()
    to_self = _to_self(sends, send_to, outs, recv_from, me)
    ops = [
        dist.P2POp(dist.isend, x.detach().contiguous(), dst, g.pg, tag)
        for x, (dst, tag) in zip(sends, send_to, strict=True)
        if dst not in (-1, me) and x.numel() > 0
    ]
    ops += [
        dist.P2POp(dist.irecv, out, src, g.pg, tag)
        for j, (out, (src, tag)) in enumerate(zip(outs, recv_from, strict=True))
        if src != -1 and j not in to_self and out.numel() > 0
    ]
    if ops:  # not traced: only some of the group's ranks take part in point-to-point
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    sent = sum(_nbytes(x) for x, (d, _) in zip(sends, send_to, strict=True) if d not in (-1, me))
    return outs, sent


def exchange(
    kind: str,
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    recv_from: Sequence[tuple[int, int]],
    recv_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    group: str | Group | None,
) -> list[torch.Tensor]:
    """Point-to-point: send ``sends[i]`` to ``send_to[i] = (global rank, tag)``; receive slot j
    from ``recv_from[j] = (global rank, tag)`` with shape ``recv_shapes[j]``. A peer of -1 means
    "no transfer" (that receive slot holds zeros). Messages with the same source, destination
    and tag pair up in order. Every peer must be a member of `group`.
    """
    g = resolve_group(group)
    start = recorder.start()
    sim = _sim.current()
    if sim is not None:
        outs, sent = sim.exchange(kind, sends, send_to, recv_from, recv_shapes, dtype, g.ranks)
    else:
        outs, sent = _p2p(kind, sends, send_to, recv_from, recv_shapes, dtype, device, g)
    if recorder.recording():
        numel = sum(x.numel() for x in sends)
        recorder.record(kind, g.ranks, dtype, numel, sent, recorder.timer() - start)
    return outs
