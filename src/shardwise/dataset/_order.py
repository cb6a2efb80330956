"""Which sample indices one rank reads in one epoch, in which order and in which batches.

Everything here works on integer indices only (no data is touched), in the main process, so
that every rank computes the same global order from the same seed and then keeps its share:

- `mix_seed`: a seed for one (pipeline seed, epoch, step) from a hash, so epochs differ and
  repeat exactly.
- `source_order`: the source's order for an epoch (identity or a seeded permutation).
- `buffer_shuffle`: MindSpore's ``shuffle(buffer_size)``: a sliding buffer of that size.
- `shard_positions` / `samples_per_rank`: the per-rank share of the global order (see
  `shard_positions` for the scheme and the trailing partial global batch).
- `EpochOrder.batches`: the four steps above in pipeline order, split into index batches.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
UNBATCHED_CHUNK = 256  # samples fetched per loader step when the pipeline has no batch()


def mix_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (a hash, so nearby inputs give unrelated seeds).

    Example:
        >>> mix_seed(1, 0) != mix_seed(1, 1)
        True
    """
    data = b"".join((p & _MASK64).to_bytes(8, "little") for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def source_order(n: int, shuffle: bool, seed: int) -> torch.Tensor:
    """``arange(n)``, or a permutation of it drawn from `seed` when `shuffle`."""
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen, dtype=torch.int64)


def buffer_shuffle(items: Sequence[int], buffer_size: int, seed: int) -> list[int]:
    """MindSpore's buffered shuffle of `items`, reproducible from `seed`.

    The first `buffer_size` items fill a buffer; each later item replaces a randomly chosen
    buffer entry, which is emitted; the remaining buffer is emitted in random order. A buffer
    at least as large as `items` gives a uniform permutation.

    Example:
        >>> sorted(buffer_shuffle(range(10), 4, seed=0)) == list(range(10))
        True
    """
    rng = random.Random(seed)
    buf: list[int] = []
    out: list[int] = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = rng.randrange(buffer_size)
        out.append(buf[j])
        buf[j] = item
    rng.shuffle(buf)
    out.extend(buf)
    return out


def samples_per_rank(length: int, num_shards: int, block: int, drop_remainder: bool) -> int:
    """How many samples each rank gets from a global order of `length` (see `shard_positions`)."""
    group = num_shards * block
    full, rem = divmod(length, group)
    if rem == 0 or drop_remainder:
        return full * block
    if num_shards == 1:
        return length
    return (full + 1) * block


def shard_positions(
    length: int, num_shards: int, shard_id: int, block: int, drop_remainder: bool
) -> torch.Tensor:
    """Positions in the global order that rank `shard_id` of `num_shards` reads.

    The global order is cut into global batches of ``num_shards * block`` positions; rank r
    takes rows ``[r * block, (r + 1) * block)`` of each, i.e. position p when
    ``(p // block) % num_shards == r``. `block` is the per-rank batch size (1 without batch:
    round robin).

    A trailing partial global batch of ``rem`` positions is dropped when `drop_remainder`.
    Otherwise, with one shard it is kept as is (a short last batch); with several shards it is
    completed to a full global batch by wrapping around to the start of the global order
    (positions ``length, length + 1, ...`` read as ``0, 1, ...``), so every rank yields the same
    number of equally sized batches, like ``torch.utils.data.DistributedSampler`` pads.

    Example:
        >>> shard_positions(10, 2, 1, 2, drop_remainder=False).tolist()   # 10 samples, 2 ranks
        [2, 3, 6, 7, 0, 1]
    """
    group = num_shards * block
    full, rem = divmod(length, group)
    starts = torch.arange(full, dtype=torch.int64) * group + shard_id * block
    pos = (starts[:, None] + torch.arange(block, dtype=torch.int64)[None, :]).reshape(-1)
    if rem == 0 or drop_remainder:
        return pos
    if num_shards == 1:
        tail = torch.arange(full * group, length, dtype=torch.int64)
    else:
        tail = (full * group + shard_id * block + torch.arange(block, dtype=torch.int64)) % length
    return torch.cat([pos, tail])


@dataclass(frozen=True)
class EpochOrder:
    """The index-level part of a pipeline: everything that decides which rows go where.

    Attributes:
        seed: the pipeline seed (``torch.initial_seed()`` when the source was created).
        shuffle_source: permute the source each epoch.
        num_samples: keep at most this many samples per shard (None: all).
        sample_shuffles: buffer sizes of the ``shuffle()`` calls before ``batch()``.
        batch_size: the per-rank batch size, None without ``batch()``.
        drop_remainder: ``batch(drop_remainder=...)``.
        batch_shuffles: buffer sizes of the ``shuffle()`` calls after ``batch()``.
    """

    seed: int
    shuffle_source: bool
    num_samples: int | None = None
    sample_shuffles: tuple[int, ...] = ()
    batch_size: int | None = None
    drop_remainder: bool = False
    batch_shuffles: tuple[int, ...] = ()

    def global_order(self, n: int, num_shards: int, epoch: int) -> torch.Tensor:
        """The order of source indices every rank agrees on, before sharding."""
        order = source_order(n, self.shuffle_source, mix_seed(self.seed, epoch, 0))
        if self.num_samples is not None:
            order = order[: self.num_samples * num_shards]
        for k, size in enumerate(self.sample_shuffles):
            shuffled = buffer_shuffle(order.tolist(), size, mix_seed(self.seed, epoch, 1, k))
            order = torch.tensor(shuffled, dtype=torch.int64)
        return order

    def num_rows(self, n: int, num_shards: int) -> int:
        """Rows (batches, or samples without ``batch()``) one rank yields per epoch."""
        length = n if self.num_samples is None else min(n, self.num_samples * num_shards)
        block = self.batch_size or 1
        count = samples_per_rank(length, num_shards, block, self.drop_remainder)
        return count if self.batch_size is None else -(-count // self.batch_size)

    def padding(self, n: int, num_shards: int, shard_id: int) -> int:
        """Rows at the end of this rank's last batch that repeat the start of the order (wrap;
        a ``shuffle()`` after ``batch()`` keeps that batch last, on every rank)."""
        length = n if self.num_samples is None else min(n, self.num_samples * num_shards)
        block = self.batch_size or 1
        rem = length % (num_shards * block)
        if num_shards == 1 or rem == 0 or (self.drop_remainder and self.batch_size is not None):
            return 0
        return block - min(max(rem - shard_id * block, 0), block)

    def batches(self, n: int, num_shards: int, shard_id: int, epoch: int) -> list[torch.Tensor]:
        """The index batches rank `shard_id` reads in `epoch` (chunks of 256 without batch)."""
        order = self.global_order(n, num_shards, epoch)
        block = self.batch_size or 1
        drop = self.drop_remainder and self.batch_size is not None
        mine = order[shard_positions(len(order), num_shards, shard_id, block, drop)]
        chunks = [c for c in mine.split(self.batch_size or UNBATCHED_CHUNK) if len(c)]
        last = len(chunks) - 1
        order_of = list(range(len(chunks)))
        for k, size in enumerate(self.batch_shuffles):
            perm = buffer_shuffle(range(len(chunks)), size, mix_seed(self.seed, epoch, 2, k))
            order_of = [order_of[i] for i in perm]
        if self.batch_shuffles and self.padding(n, num_shards, num_shards - 1):
            order_of.remove(last)  # (the batch that wraps stays last on every rank: `padding`)
            order_of.append(last)
        return [chunks[i] for i in order_of]
