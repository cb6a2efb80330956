"""Bucketed AllGather / ReduceScatter: one collective over several tensors (a fusion bucket).

- `all_gather_bucket(shards, group)`: for every member, the pieces of every rank stacked on
  dim 0 in group-rank order (member m's result has ``N * shards[m].shape[0]`` rows).
- `reduce_scatter_bucket(tensors, op, group)`: every member reduced over the group; rank i gets
  the i-th dim-0 chunk of each member.

Both start the collective and return a `Pending` whose ``wait()`` gives the per-member results
and records ONE AllGather / ReduceScatter of the bucket's total size. Two transports
(`_transport` picks):

- **pairwise** (real gloo groups, buckets of at least `PAIRWISE_MIN_BYTES` per rank, or any
  bucket inside `_pairwise.coalesced()`): at step k = 1..N-1 each rank sends the rank k places
  after it ONE message holding every member's piece (`_pairwise.Exchange`: on gloo each
  message in flight costs a notification round trip) and receives one from the rank k places
  before; a one-member bucket travels straight from the member into its place in the result.
  (N-1)/N of the bucket per rank (the bound). On 2 CPU cores this is about twice as fast as
  gloo's own allgather / alltoall at 4-16 MiB (N = 2 and 4; bench/README.md, "Optimizer
  parallel"). Buckets started together inside `coalesced()` share their messages (one per
  peer) and are still recorded as one collective each.
- **flat** (NCCL, simulated worlds, small buckets): the members packed chunk-major into one
  buffer, one `all_gather` / `reduce_scatter` of `_collectives`, the results unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from shardwise.communication import _pairwise, _sim, recorder
from shardwise.communication._collectives import (
    Pending,
    ReduceOp,
    _check_dim0,
    _start_all_gather,
    _start_reduce_scatter,
    deferred_record,
    free_now,
)
from shardwise.communication._init import Group, resolve_group

PAIRWISE_MIN_BYTES = 256 * 1024  # per rank; below it one gloo collective beats 2(N-1) messages


def _check_members(what: str, tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError(f"{what}: a bucket needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(
            f"{what}: a bucket's tensors must share one dtype; got {sorted(map(str, dtypes))}"
        )
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{what}: every tensor needs at least one dimension (pieces on dim 0)")


def _transport(g: Group, per_rank_bytes: int) -> str:
    """``"pairwise"`` on a real gloo group for a bucket of at least `PAIRWISE_MIN_BYTES` per
    rank, or of any size inside `coalesced()` (it joins a message that is sent anyway)."""
    n = len(g.ranks)
    if n == 1 or _sim.current() is not None:
        return "flat"
    if per_rank_bytes < PAIRWISE_MIN_BYTES and not _pairwise.coalescing():
        return "flat"
    return "pairwise" if dist.get_backend(g.pg) == "gloo" else "flat"


def all_gather_bucket(
    shards: Sequence[torch.Tensor],
    group: str | Group | None,
    outs: Sequence[torch.Tensor] | None = None,
) -> Pending[list[torch.Tensor]]:
    """Start gathering every member of a bucket over the group (see the module docstring).

    Args:
        shards: this rank's piece of each member (same dtype, at least 1-d).
        group: the group (name, `Group` or None for the world).
        outs: contiguous tensors to gather into (one per member, ``N * rows`` rows), e.g. last
            step's results refilled in place; None: new ones.

    Returns:
        A `Pending`; ``wait()`` gives one tensor per member, ``N * rows`` rows each (`outs`
        when given).

    Example:
        >>> got = all_gather_bucket([w_shard, b_shard], "dp").wait()  # doctest: +SKIP
    """
    g = resolve_group(group)
    _check_members("AllGather", shards)
    n = len(g.ranks)
    pieces = [s.detach().contiguous() for s in shards]
    per_rank = sum(p.numel() * p.element_size() for p in pieces)
    shapes = [(n * p.shape[0], *p.shape[1:]) for p in pieces]
    if outs is not None:
        assert [tuple(o.shape) for o in outs] == shapes and all(o.is_contiguous() for o in outs)
    if _transport(g, per_rank) == "flat":
        return _flat_gather(pieces, g, outs)
    done = deferred_record(
        "AllGather", g, pieces[0].dtype, sum(p.numel() for p in pieces), recorder.start()
    )
    if outs is None:
        outs = [p.new_empty(s) for p, s in zip(pieces, shapes, strict=True)]
    into = [*outs]

    def rows_of(m: int, position: int) -> torch.Tensor:
        rows = pieces[m].shape[0]
        return into[m].narrow(0, position * rows, rows)

    exchange, own = _pairwise.join(g, pieces[0].dtype)
    peers = exchange.peers
    parts = [  # (each member's piece goes to every peer)
        exchange.add(dict.fromkeys(peers, piece), {p: rows_of(m, p) for p in peers})
        for m, piece in enumerate(pieces)
    ]
    if own:
        exchange.post()
    for m, piece in enumerate(pieces):  # this rank's own rows, while the others travel
        rows_of(m, exchange.position).copy_(piece)

    def finish() -> list[torch.Tensor]:
        exchange.wait(parts)
        done()
        return into

    return Pending(finish)


def _flat_gather(
    pieces: list[torch.Tensor], g: Group, outs: Sequence[torch.Tensor] | None
) -> Pending[list[torch.Tensor]]:
    n, single = len(g.ranks), len(pieces) == 1
    flat = pieces[0].reshape(-1) if single else torch.cat([p.reshape(-1) for p in pieces])
    # one member: the pieces stacked on dim 0 are the result itself, gathered straight into it
    into = outs[0].view(-1) if single and outs is not None else None
    inner = _start_all_gather(flat, g, async_op=_sim.current() is None, out=into)

    def finish() -> list[torch.Tensor]:
        gathered = inner.wait()
        if single:
            if outs is None:
                return [gathered.view(n * pieces[0].shape[0], *pieces[0].shape[1:])]
            increment_version(outs[0])  # (written by the collective: mark it changed in place)
            return [outs[0]]
        rows, out, offset = gathered.view(n, -1), [], 0
        for m, p in enumerate(pieces):
            size = p.numel()
            block = rows[:, offset : offset + size]  # each rank's piece of member m, in a row
            if outs is None:  # (a member of 1 row a rank: reshape keeps the rows' stride)
                out.append(block.reshape(n * p.shape[0], *p.shape[1:]).contiguous())
            else:
                out.append(outs[m])
                outs[m].view(n, size).copy_(block)
            offset += size
        return out

    return Pending(finish)


def reduce_scatter_bucket(
    tensors: Sequence[torch.Tensor], op: ReduceOp, group: str | Group | None
) -> Pending[list[torch.Tensor]]:
    """Start reducing every member of a bucket over the group; rank i keeps the i-th dim-0
    chunk of each (see the module docstring).

    Args:
        tensors: the members (same dtype; dim 0 of each divisible by the group size).
        op: the reduction (applied in group-rank order: deterministic).
        group: the group (name, `Group` or None for the world).

    Returns:
        A `Pending`; ``wait()`` gives one new tensor per member, ``rows / N`` rows each.

    Raises:
        ValueError: mixed dtypes, a 0-d member or a dim 0 that does not divide into the group.

    Example:
        >>> pending = reduce_scatter_bucket([w.grad, b.grad], ReduceOp.SUM, "dp")  # doctest: +SKIP
        >>> w_grad, b_grad = pending.wait()  # doctest: +SKIP
    """
    g = resolve_group(group)
    n = len(g.ranks)
    _check_members("ReduceScatter", tensors)
    for t in tensors:
        _check_dim0("ReduceScatter", t, n)
    members = [t.detach().contiguous() for t in tensors]
    per_rank = sum(t.numel() * t.element_size() for t in members) // n
    if _transport(g, per_rank) == "flat":
        return _flat_scatter(members, op, g)
    numel = sum(t.numel() for t in members)
    done = deferred_record("ReduceScatter", g, members[0].dtype, numel, recorder.start())
    chunks = [t.chunk(n, 0) for t in members]
    received: list[list[torch.Tensor]] = [list(c) for c in chunks]  # [member][position]

    exchange, own = _pairwise.join(g, members[0].dtype)
    peers, parts = exchange.peers, []
    for m, chunk in enumerate(chunks):
        for p in peers:
            received[m][p] = torch.empty_like(chunk[p])
        parts.append(exchange.add({p: chunk[p] for p in peers}, {p: received[m][p] for p in peers}))
    if own:
        exchange.post()

    def finish() -> list[torch.Tensor]:
        exchange.wait(parts)
        out = [op.reduce_parts(pieces) for pieces in received]
        done()
        return out

    return Pending(finish)


def _flat_scatter(
    members: list[torch.Tensor], op: ReduceOp, g: Group
) -> Pending[list[torch.Tensor]]:
    n = len(g.ranks)
    rows = [t.reshape(n, -1) for t in members]  # chunk-major: rank i's chunks side by side
    flat = rows[0].reshape(-1) if len(rows) == 1 else torch.cat(rows, dim=1).reshape(-1)
    inner = _start_reduce_scatter(flat, op, g, async_op=_sim.current() is None)

    def finish() -> list[torch.Tensor]:
        reduced, out, offset = inner.wait(), [], 0
        for t in members:
            size = t.numel() // n
            out.append(reduced[offset : offset + size].view(t.shape[0] // n, *t.shape[1:]))
            offset += size
        if len(rows) > 1:  # (the members packed: a buffer of ours)
            free_now(flat)
        return out

    return Pending(finish)
