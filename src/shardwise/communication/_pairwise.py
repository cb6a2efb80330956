"""Pairwise exchanges on gloo: messages from every rank to every other rank of a group.

The bucket collectives (`_buckets`) move their data this way on real gloo groups. Every message
in flight between two gloo ranks costs a notification round trip handled by gloo's I/O threads,
so several small messages cost more than one message of the same bytes. An `Exchange` therefore
packs the small parts one rank sends to one peer into ONE message, across the members of a
bucket and, inside `coalesced()`, across every bucket call started in the block; a part of
`SEPARATE_BYTES` or more travels alone, straight from its tensor (packing it would cost a copy
larger than the round trip it saves).

- `join(g, dtype)`: the exchange a bucket call adds its parts to: inside `coalesced()` the one
  shared by every call on `g` with that dtype (posted when the block ends), otherwise a fresh
  one the caller posts.
- `Exchange.add` (a send part per peer and a receive target per peer), `Exchange.post` (the
  messages of `_messages`, one ``isend`` / ``irecv`` each; small parts packed with `_packed`),
  `Exchange.wait` (the messages carrying the given parts finished, their targets filled:
  received in place when a message has one target, else unpacked; a bucket waits only for
  its own messages, so a coalesced level-3 prefetch does not wait for the next bucket's).
- `coalesced()`: the block whose bucket calls share their exchanges.
- `_take` / `_give` / `release_buffers` / `pooled_bytes`: packed send buffers and receive
  boxes come from a pool of free buffers (`POOL_BYTES` at most) and go back when their message
  finished: a fresh buffer would cost page faults and cold caches on every step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardwise.communication import _trace
from shardwise.communication._init import Group

_TAG_BASE = 1 << 24  # above the tags users give NeighborExchange (same send/recv slot space)
_tags: dict[tuple[int, ...], int] = {}  # group ranks -> the next tag (same order on every rank)
SEPARATE_BYTES = 1 << 20  # a part this large travels in a message of its own
_open: list[dict[tuple[tuple[int, ...], torch.dtype], Exchange]] = []  # open coalesced blocks
POOL_BYTES = 64 << 20  # at most this many bytes of free pack / receive buffers kept for reuse
_pool: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
_pooled = [0]  # bytes in `_pool`


def _next_tag(g: Group, count: int) -> int:
    """The first of `count` fresh message tags for one exchange on group `g` (the same on
    every rank)."""
    tag = _tags.get(g.ranks, 0)
    _tags[g.ranks] = (tag + count) % (1 << 20)
    return _TAG_BASE + tag


def _numel(parts: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in parts)


def _messages(parts: Sequence[torch.Tensor]) -> list[list[int]]:
    """The parts (indices) of each message to one peer: every part smaller than
    `SEPARATE_BYTES` in one packed message (first), each larger part in a message of its own
    (no packing copy; a round trip is small next to its transfer)."""
    small = [i for i, p in enumerate(parts) if p.numel() * p.element_size() < SEPARATE_BYTES]
    alone = [[i] for i in range(len(parts)) if i not in small]
    return ([small] if small else []) + alone


def _take(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of `numel` elements of `like`'s dtype and device: a pooled one when free
    (its pages mapped and warm: a fresh 1.3 MB buffer costs ~0.15 ms of page faults here)."""
    free = _pool.get((numel, like.dtype, like.device))
    if not free:
        return like.new_empty(numel)
    buffer = free.pop()
    _pooled[0] -= numel * buffer.element_size()
    return buffer


def _give(buffer: torch.Tensor) -> None:
    """Return a `_take` buffer no message uses any more (kept while the pool is under
    `POOL_BYTES`)."""
    size = buffer.numel() * buffer.element_size()
    if _pooled[0] + size > POOL_BYTES:
        return
    _pool.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)
    _pooled[0] += size


def pooled_bytes() -> int:
    """Bytes of free message buffers the pool holds now: after a training step, what it keeps
    until the next (the memory model's "pooled message buffers", ``report/_pool.py``).

    Example:
        >>> release_buffers(); pooled_bytes()
        0
    """
    return _pooled[0]


def release_buffers() -> None:
    """Free the pooled message buffers (they are made again as messages need them): between
    two jobs run in one process, or before measuring a fresh job's memory."""
    _pool.clear()
    _pooled[0] = 0


def _packed(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat message of `parts` (the part itself when there is one: no copy)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.reshape(-1) for p in parts], out=_take(_numel(parts), parts[0]))


def _unpacked(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a `_packed` message shaped as `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class _Sent:
    """A message's send buffer, shared by the messages carrying the same parts to every peer; a
    packed (pooled) one goes back to the pool when the last of them finished."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.buffer, self.pooled, self.users = _packed(parts), len(parts) > 1, 0

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.pooled:
            _give(self.buffer)


class _Message:
    """One message to and one from a peer: its works, send and receive buffers and targets."""

    def __init__(
        self, sent: _Sent, box: torch.Tensor, targets: list[torch.Tensor], works: list[Any]
    ) -> None:
        self.sent, self.box, self.targets, self.works = sent, box, targets, works
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        for work in self.works:
            work.wait()
        if len(self.targets) > 1:  # (a pooled box: give it back once unpacked)
            for target, got in zip(self.targets, _unpacked(self.box, self.targets), strict=True):
                target.copy_(got)
            _give(self.box)
        self.sent.release()
        self.done = True
        self.works, self.targets = [], []


class Exchange:
    """What this rank sends to and fills from every peer of group `g` (positions in the group).

    Args:
        g: the group (this rank is a member).
    """

    def __init__(self, g: Group) -> None:
        self.g = g
        self.position = g.ranks.index(dist.get_rank())
        self.peers = [p for p in range(len(g.ranks)) if p != self.position]
        self._out: dict[int, list[torch.Tensor]] = {p: [] for p in self.peers}
        self._into: dict[int, list[torch.Tensor]] = {p: [] for p in self.peers}
        self._carrying: dict[int, list[_Message]] = {}  # part index -> the messages with it
        self._posted = False
        self._token: _trace.Token = None

    def add(self, send: Mapping[int, torch.Tensor], recv: Mapping[int, torch.Tensor]) -> int:
        """Add ``send[peer]`` to the messages to each peer (`peers`) and ``recv[peer]``
        (contiguous) to the targets filled from each peer's messages; returns the part's index
        (for `wait`)."""
        assert not self._posted, "exchange already posted"
        for peer in self.peers:
            self._out[peer].append(send[peer])
            self._into[peer].append(recv[peer])
        return len(self._out[self.peers[0]]) - 1

    def post(self) -> None:
        """At step k = 1..N-1 send the messages to the rank k positions after this one and
        receive those from the rank k positions before (`_messages` groups the parts)."""
        n, pos, g = len(self.g.ranks), self.position, self.g
        groups = _messages(self._out[self.peers[0]])  # (the same sizes for every peer)
        tag = _next_tag(g, len(groups))
        self._token = _trace.enter("BucketExchange", g)
        packed: dict[tuple[int, ...], _Sent] = {}  # the same parts: packed once
        for k in range(1, n):
            dst, src = (pos + k) % n, (pos - k) % n
            for j, members in enumerate(groups):
                parts = [self._out[dst][i] for i in members]
                key = tuple(id(p) for p in parts)
                if key not in packed:
                    packed[key] = _Sent(parts)
                sent = packed[key]
                sent.users += 1
                targets = [self._into[src][i] for i in members]
                box = targets[0] if len(targets) == 1 else _take(_numel(targets), targets[0])
                works = [
                    dist.isend(sent.buffer, g.ranks[dst], g.pg, tag + j),
                    dist.irecv(box, g.ranks[src], g.pg, tag + j),
                ]
                message = _Message(sent, box, targets, [w for w in works if w is not None])
                for i in members:
                    self._carrying.setdefault(i, []).append(message)
        self._posted = True
        self._out, self._into = {}, {}

    def wait(self, parts: Sequence[int]) -> None:
        """Finish the messages carrying `parts` (indices from `add`) and fill their targets;
        the exchange's other messages may still be travelling."""
        assert self._posted, "exchange waited for before it was posted"
        for i in parts:
            for message in self._carrying.get(i, []):
                message.finish()
        if all(m.done for ms in self._carrying.values() for m in ms):
            _trace.leave(self._token)

    def __str__(self) -> str:
        return f"Exchange(group={list(self.g.ranks)}, posted={self._posted})"


def coalescing() -> bool:
    """Whether a `coalesced()` block is open."""
    return bool(_open)


def join(g: Group, dtype: torch.dtype) -> tuple[Exchange, bool]:
    """The exchange for a bucket call on `g`: (the open block's shared one, False) inside
    `coalesced()`, else (a fresh one, True: the caller posts it after adding its parts)."""
    if not _open:
        return Exchange(g), True
    key = (g.ranks, dtype)
    if key not in _open[-1]:
        _open[-1][key] = Exchange(g)
    return _open[-1][key], False


@contextmanager
def coalesced() -> Iterator[None]:
    """Bucket collectives started in the block share one message per peer and group; the
    messages are posted when the block ends (wait for the results after it).

    Example:
        >>> with coalesced():  # doctest: +SKIP
        ...     a = all_gather_bucket([w1], "dp")
        ...     b = all_gather_bucket([w2, b2], "dp")
        >>> w1_full, = a.wait()  # doctest: +SKIP
    """
    block: dict[tuple[tuple[int, ...], torch.dtype], Exchange] = {}
    _open.append(block)
    try:
        yield
    finally:
        _open.pop()
    for exchange in block.values():  # (not on an exception: its calls' results are unusable)
        exchange.post()
