"""The packed message buffers of optimizer parallel on gloo, and what the pool keeps of them:
part of the memory model (``report/_memory.py``).

On a gloo group the shard buckets' AllGathers and ReduceScatters move their data by pairwise
messages (`communication._pairwise`): the pieces under ``SEPARATE_BYTES`` that one exchange
(one shard group and dtype) sends to a peer travel as ONE packed message. Where a message packs
more than one piece, its send buffer and its receive boxes come from a pool of free buffers,
and go back to it when the message is finished; a buffer is reused only for a message of the
same length and dtype (a *key*). An AllGather takes ``s`` buffers (one send buffer, the same
pieces go to every peer, and ``s - 1`` boxes), a ReduceScatter ``2 (s - 1)`` (a send buffer and
a box per peer). A bucket call outside ``coalesced()`` uses messages only from
``PAIRWISE_MIN_BYTES`` per rank (below: one gloo collective, no pool).

After the first step the pool holds, per key, the most buffers of that key out at once during
a step (a take finds a free one, or makes one that is then kept), and every take of a later
step reuses them: so the pool's bytes are held at rest, and the step's packed messages add
nothing on top. `pooled_buffers` walks one step in the order the engine
(``optim/_engine*.py``) takes and gives them:

- levels 1-2, forward: every shard bucket's AllGather started together (coalesced), each
  exchange's buffers given back at its first bucket's use;
- level 1, optimizer step: every shard bucket's ReduceScatter started together (coalesced);
- levels 2-3, backward: each bucket's ReduceScatter started alone when its gradients are
  complete (buckets in reverse order), all finished at the end of backward;
- level 3, forward: bucket ``k``'s first use starts bucket ``k + 1`` (coalesced; the first
  use starts buckets 0 and 1 together) before it waits for its own;
- level 3, backward: a bucket autograd saved a weight of is gathered again at its first
  unpack, started together with the previous saved bucket (prefetch), then waited.

The pool keeps at most ``POOL_BYTES``: beyond that the buffers are made during the step (priced
at the gradient reduction, where the most are out) and freed when their message finishes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from shardwise.communication._buckets import PAIRWISE_MIN_BYTES
from shardwise.communication._pairwise import POOL_BYTES, SEPARATE_BYTES
from shardwise.optim import OptimizerPlan
from shardwise.optim._plan import Bucket

Key = tuple[int, torch.dtype]
"""A packed message's length (elements) and dtype: pooled buffers of one key are reused."""
Pieces = Mapping[str, tuple[int, torch.dtype]]
"""Each parameter's shard piece on this rank: (elements, dtype)."""


def pooled_buffers(
    optimizer: OptimizerPlan | None, pieces: Pieces, saved: Sequence[int] = ()
) -> Counter[Key]:
    """The pool's buffers after a step (the most of each key out at once; see the module
    docstring). `saved`: at level 3, the shard buckets (positions among them) autograd saves a
    weight of, gathered again in backward."""
    if optimizer is None:
        return Counter()
    shard = [b for b in optimizer.buckets if b.kind == "shard"]
    level = optimizer.config.optimizer_level
    walk = _Walk(pieces)
    if level == "level3":
        walk.forward_level3(shard)
    else:
        walk.together(shard, gather=True)
    if level == "level1":
        walk.together(shard, gather=False)
    else:
        walk.backward(shard, saved if level == "level3" else ())
    return walk.most


def split_at_pool(buffers: Counter[Key]) -> tuple[int, int]:
    """(bytes the pool keeps between steps, bytes beyond `POOL_BYTES` made each step)."""
    total = sum(n * numel * dtype.itemsize for (numel, dtype), n in buffers.items())
    kept = min(total, POOL_BYTES)
    return kept, total - kept


class _Walk:
    """One step's takes and gives, with the most buffers of each key out at once."""

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.out: Counter[Key] = Counter()
        self.most: Counter[Key] = Counter()

    def take(self, buffers: Counter[Key]) -> None:
        self.out.update(buffers)
        for key in buffers:
            self.most[key] = max(self.most[key], self.out[key])

    def give(self, buffers: Counter[Key]) -> None:
        self.out.subtract(buffers)

    def exchanges(self, buckets: Sequence[Bucket], gather: bool) -> list[Counter[Key]]:
        """The pooled buffers of bucket calls started together: one exchange per shard group
        and dtype, whose pieces under ``SEPARATE_BYTES`` share one packed message per peer
        (pooled when it packs more than one)."""
        small: dict[tuple[tuple[int, ...], int, torch.dtype], list[int]] = {}
        for b in buckets:
            for name in b.names:
                numel, dtype = self.pieces.get(name, (0, torch.uint8))
                if 0 < numel * dtype.itemsize < SEPARATE_BYTES:
                    small.setdefault((b.dp_axes, b.shard, dtype), []).append(numel)
        out = []
        for (_, s, dtype), sizes in small.items():
            if len(sizes) > 1:
                out.append(Counter({(sum(sizes), dtype): s if gather else 2 * (s - 1)}))
        return out

    def alone(self, bucket: Bucket, gather: bool) -> Counter[Key]:
        """A bucket call outside ``coalesced()``: messages only from ``PAIRWISE_MIN_BYTES``."""
        known = [self.pieces[m] for m in bucket.names if m in self.pieces]
        per_rank = sum(n * d.itemsize for n, d in known)
        if per_rank < PAIRWISE_MIN_BYTES:
            return Counter()
        return sum(self.exchanges([bucket], gather), Counter())

    def together(self, buckets: Sequence[Bucket], gather: bool) -> None:
        every = sum(self.exchanges(buckets, gather), Counter())
        self.take(every)
        self.give(every)

    def started_together(
        self, block: Sequence[int], shard: Sequence[Bucket]
    ) -> dict[int, Counter[Key]]:
        """Buckets `block` (positions in `shard`) started together (coalesced): one exchange per
        shard group, listed under each of its buckets (given back once, at the first wait)."""
        out: dict[int, Counter[Key]] = {}
        for group in {(shard[j].dp_axes, shard[j].shard) for j in block}:
            members = [j for j in block if (shard[j].dp_axes, shard[j].shard) == group]
            buffers = sum(self.exchanges([shard[j] for j in members], True), Counter())
            self.take(buffers)
            out.update(dict.fromkeys(members, buffers))
        return out

    def wait(self, buffers: Counter[Key]) -> None:
        self.give(buffers)
        buffers.clear()  # (an exchange shared with another bucket: given back once)

    def forward_level3(self, shard: Sequence[Bucket]) -> None:
        """Bucket k's first use starts k + 1 (0 and 1 together), then waits for k."""
        waiting: dict[int, Counter[Key]] = {}  # bucket -> its exchange's buffers
        for k in range(len(shard)):
            block = [j for j in (k, k + 1) if j < len(shard) and j not in waiting]
            waiting.update(self.started_together(block, shard))
            self.wait(waiting[k])

    def backward(self, shard: Sequence[Bucket], saved: Sequence[int]) -> None:
        """Reverse order: (level 3) the bucket's gather again and the previous saved one's,
        started together, then its ReduceScatter; all finished at the end of backward."""
        regathering: dict[int, Counter[Key]] = {}
        reductions: Counter[Key] = Counter()
        for k in reversed(range(len(shard))):
            if k in saved:
                earlier = [j for j in saved if j < k]
                block = [j for j in [k, *earlier[-1:]] if j not in regathering]
                regathering.update(self.started_together(block, shard))
                self.wait(regathering[k])
            buffers = self.alone(shard[k], gather=False)
            self.take(buffers)
            reductions.update(buffers)
        self.give(reductions)
