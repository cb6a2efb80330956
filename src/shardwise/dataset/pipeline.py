"""The dataset pipeline: ``source.map(...).shuffle(...).batch(...)``, iterated as torch tensors.

A `Dataset` is an immutable description; ``map``, ``shuffle`` and ``batch`` each return a new
one. Iterating runs one epoch:

1. `_Spec.shard.resolve` fixes ``(num_shards, shard_id)`` (lazily: ``batch()`` may come later
   and ``num_shards="auto"`` follows the job);
2. `EpochOrder.batches` computes, from the seed and the epoch number only, the global order
   and this rank's index batches (`_order`);
3. ``torch.utils.data.DataLoader`` runs `Fetcher` on those index batches (in
   ``num_parallel_workers`` worker processes when > 0, pinned when CUDA is available), each
   under a torch seed of its own (pipeline seed, epoch, shard, step), so random map ops give
   the same batches whatever the number of workers and never draw the global RNG;
4. the batches (or, without ``batch()``, the rows) come out as tuples of tensors.

`Dataset._epoch_rows` does 1-4; `create_tuple_iterator` / `create_dict_iterator` wrap it as
MindSpore's re-iterable multi-epoch iterators (`_iterate.EpochIterator`). A source takes its seed
when created (`pipeline_seed`: torch's once the script seeded it, else MindSpore's constant).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self, cast

import torch
from torch.utils.data import DataLoader

from shardwise.context import torch_seeded
from shardwise.dataset._args import (
    check_flag,
    check_int,
    check_ops,
    check_positive,
    check_workers,
)
from shardwise.dataset._fetch import Fetcher, IndexBatch, MapStep, identity_collate
from shardwise.dataset._iterate import EpochIterator, pick
from shardwise.dataset._order import EpochOrder, mix_seed
from shardwise.dataset._shard import ShardSetting, agree_seed
from shardwise.dataset._sources import Row, Source, row_count, table_for

__all__ = ["Dataset", "EpochIterator", "source_spec"]


@dataclass(frozen=True)
class _Spec:
    source: Source
    names: tuple[str, ...]
    order: EpochOrder
    shard: ShardSetting
    sample_maps: tuple[MapStep, ...] = ()
    batch_maps: tuple[MapStep, ...] = ()
    workers: int = 0
    trail: tuple[str, ...] = ()


class Dataset:
    """A data pipeline yielding tuples of torch tensors, one per column, in column order.

    Built by `MnistDataset` or `GeneratorDataset` and extended with `map`, `shuffle` and
    `batch`. Each ``for`` loop over it is one epoch; epochs are reshuffled deterministically
    (the order depends only on the seed captured when the source was created, the epoch
    number and the shard).
    """

    def __init__(self, spec: _Spec) -> None:
        self._spec = spec
        self._epoch = 0
        self._agreed_seed: int | None = None

    def __repr__(self) -> str:
        return " -> ".join(self._spec.trail) or "Dataset()"

    def _derive(self, step: str, **changes: Any) -> Self:
        """A new pipeline of the same class (so ``ds = ds.map(...)`` type-checks) with `changes`;
        it starts at epoch 0 and does not run the subclass's ``__init__``."""
        spec = replace(self._spec, trail=(*self._spec.trail, step), **changes)
        derived = object.__new__(type(self))
        Dataset.__init__(derived, spec)
        return derived

    # -- building ------------------------------------------------------------------------
    def map(
        self,
        operations: Callable[..., Any] | Sequence[Callable[..., Any]],
        input_columns: str | Sequence[str] | None = None,
        num_parallel_workers: int | None = None,
    ) -> Self:
        """Apply `operations`, in order, to the `input_columns`.

        A built-in transform (``vision.Rescale``, ``transforms.TypeCast``, ...) transforms each
        named column on its own. Any other callable receives the named columns as positional
        arguments and returns one value per column (a tuple when several). Before ``batch()``
        an op sees one sample (built-in transforms run vectorized over the batch); after
        ``batch()`` it sees the whole batch.

        Args:
            operations: a callable or a list of callables.
            input_columns: a column name or a list of them; None means the first column.
            num_parallel_workers: worker processes for the whole pipeline (None: unchanged).

        Returns:
            The extended pipeline.

        Raises:
            TypeError: an operation that is not callable.
            ValueError: an unknown column name; the message lists the columns.

        Example:
            >>> ds = ds.map([vision.Rescale(1.0 / 255.0, 0), vision.HWC2CHW()], "image")
        """
        ops = check_ops(operations)
        if input_columns is None:
            names: tuple[str, ...] = self._spec.names[:1]
        elif isinstance(input_columns, str):
            names = (input_columns,)
        else:
            names = tuple(input_columns)
        unknown = [n for n in names if n not in self._spec.names]
        if unknown or not names:
            raise ValueError(
                f"map: unknown input column(s) {unknown or names}; the columns are "
                f"{list(self._spec.names)}"
            )
        step = MapStep(ops, tuple(self._spec.names.index(n) for n in names), names)
        workers = self._spec.workers
        if num_parallel_workers is not None:
            workers = check_workers(num_parallel_workers, "map")
        label = f"map({', '.join(type(o).__name__ for o in ops)} on {list(names)})"
        if self._spec.order.batch_size is None:
            return self._derive(label, sample_maps=(*self._spec.sample_maps, step), workers=workers)
        return self._derive(label, batch_maps=(*self._spec.batch_maps, step), workers=workers)

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_workers: int | None = None,
    ) -> Self:
        """Group consecutive rows into batches of `batch_size` (per rank when sharded).

        Args:
            batch_size: rows per batch on this rank; with N shards a global batch holds
                ``N * batch_size`` rows, and rank r's batch is rows ``[r*b, (r+1)*b)`` of it.
            drop_remainder: drop a trailing partial (global) batch. When False, one shard
                yields a short last batch; several shards complete it by wrapping around to
                the start of the epoch's order, so every rank yields the same batch count.
            num_parallel_workers: worker processes for the whole pipeline (None: unchanged).

        Returns:
            The batched pipeline.

        Raises:
            ValueError: `batch_size` < 1, or the pipeline is already batched.

        Example:
            >>> ds = ds.batch(32, drop_remainder=True)
        """
        batch_size = check_positive(batch_size, "batch", "batch_size")
        if self._spec.order.batch_size is not None:
            raise ValueError(
                f"batch: the pipeline is already batched ({self!r}); call batch() once"
            )
        workers = self._spec.workers
        if num_parallel_workers is not None:
            workers = check_workers(num_parallel_workers, "batch")
        drop = check_flag(drop_remainder, "batch", "drop_remainder")
        order = replace(self._spec.order, batch_size=batch_size, drop_remainder=drop)
        label = f"batch({batch_size}, drop_remainder={drop})"
        return self._derive(label, order=order, workers=workers)

    def shuffle(self, buffer_size: int) -> Self:
        """Shuffle rows (or, after ``batch()``, whole batches) through a buffer of `buffer_size`.

        The shuffle acts on the global order, before sharding, so every rank agrees on it; a
        buffer at least as large as the dataset is a full shuffle.

        Args:
            buffer_size: the buffer size, >= 2.

        Returns:
            The extended pipeline.

        Raises:
            ValueError: `buffer_size` < 2.

        Example:
            >>> ds = ds.shuffle(buffer_size=10000)
        """
        buffer_size = check_int(buffer_size, "shuffle", "buffer_size", 2)
        order = self._spec.order
        if order.batch_size is None:
            order = replace(order, sample_shuffles=(*order.sample_shuffles, buffer_size))
        else:
            order = replace(order, batch_shuffles=(*order.batch_shuffles, buffer_size))
        return self._derive(f"shuffle({buffer_size})", order=order)

    # -- inspecting ----------------------------------------------------------------------
    def get_col_names(self) -> list[str]:
        """The column names, in the order iteration yields them."""
        return list(self._spec.names)

    def get_batch_size(self) -> int:
        """The per-rank batch size (1 without ``batch()``)."""
        return self._spec.order.batch_size or 1

    def get_shard(self) -> tuple[int, int]:
        """``(num_shards, shard_id)`` as resolved now (``(1, 0)`` when not sharded)."""
        return self._spec.shard.resolve()

    @property
    def num_shards(self) -> int:
        """The number of shards as resolved now (1 when not sharded)."""
        return self.get_shard()[0]

    @property
    def shard_id(self) -> int:
        """This pipeline's shard as resolved now (0 when not sharded)."""
        return self.get_shard()[1]

    def get_padding(self) -> int:
        """Rows at the end of this rank's last batch that wrap around to the epoch's first rows.

        Non-zero only when sharded with ``drop_remainder=False`` and the data does not fill the
        last global batch; an exact evaluation drops them: ``batch[: len(batch) - pad]``.

        Example:
            >>> ds = GeneratorDataset(list(range(10)), "x", num_shards=2, shard_id=1)
            >>> ds.batch(2).get_padding()       # its last batch holds rows 0 and 1 again
            2
        """
        num_shards, shard_id = self._spec.shard.resolve()
        return self._spec.order.padding(row_count(self._spec.source), num_shards, shard_id)

    def get_dataset_size(self) -> int:
        """Batches (rows without ``batch()``) this rank yields per epoch; equal on all ranks.

        A generator source that was never read is read once to count its rows (the rows are
        kept for the next epoch); afterwards the count of the last read is used.

        Example:
            >>> MnistDataset("data/MNIST").batch(32).get_dataset_size()
            1875
        """
        num_shards, _ = self._spec.shard.resolve()
        return self._spec.order.num_rows(row_count(self._spec.source), num_shards)

    def __len__(self) -> int:
        return self.get_dataset_size()

    def size_note(self) -> str:
        """How an epoch's rows become this rank's batches, for messages.

        Example:
            >>> GeneratorDataset(list(range(6)), "x").batch(8, drop_remainder=True).size_note()
            '6 rows, batch(8, drop_remainder=True): 0 batches per epoch'
        """
        order, (num_shards, _) = self._spec.order, self._spec.shard.resolve()
        rows = row_count(self._spec.source)
        note = f"{rows} rows"
        if order.num_samples is not None and order.num_samples * num_shards < rows:
            note += f" (num_samples={order.num_samples} read per shard)"
        if num_shards > 1:
            note += f" over {num_shards} shards"
        if order.batch_size is not None:
            note += f", batch({order.batch_size}, drop_remainder={order.drop_remainder})"
        unit = "batches" if order.batch_size is not None else "rows"
        return f"{note}: {order.num_rows(rows, num_shards)} {unit} per epoch"

    # -- iterating -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch `epoch` (each iteration otherwise counts up from 0)."""
        self._epoch = check_int(epoch, "set_epoch", "epoch", 0)

    def _seed(self, num_shards: int) -> int:
        seed = self._spec.order.seed
        if self._spec.shard.is_auto and num_shards > 1:
            if self._agreed_seed is None:
                self._agreed_seed = agree_seed(seed)
            return self._agreed_seed
        return seed

    def _epoch_rows(self, epoch: int) -> Iterator[Row]:
        spec = self._spec
        num_shards, shard_id = spec.shard.resolve()
        seed = self._seed(num_shards)
        order = replace(spec.order, seed=seed)
        table = table_for(spec.source, epoch)
        batched = order.batch_size is not None
        batches = order.batches(len(table), num_shards, shard_id, epoch)
        steps = [
            IndexBatch(b, mix_seed(seed, epoch, 4, num_shards, shard_id, k))
            for k, b in enumerate(batches)
        ]
        fetcher = Fetcher(table, spec.names, spec.sample_maps, spec.batch_maps, batched)
        loader = DataLoader(
            fetcher,
            # `IndexBatch`es, not lists: Fetcher.__getitems__ takes them as they are
            batch_sampler=cast(Iterable[list[Any]], steps),
            collate_fn=identity_collate,
            num_workers=spec.workers,
            pin_memory=batched and torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(mix_seed(seed, epoch, 3)),
        )
        for item in loader:
            if batched:
                yield tuple(item)
            else:
                yield from item

    def _next_epoch(self) -> Iterator[Row]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self._epoch_rows(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """One epoch of tuples of tensors (the next epoch on the next loop)."""
        return self._next_epoch()

    def create_tuple_iterator(
        self,
        columns: Sequence[str] | None = None,
        num_epochs: int = -1,
        output_numpy: bool = False,
    ) -> EpochIterator:
        """MindSpore's tuple iterator: each ``for`` loop over it runs one more epoch.

        Args:
            columns: the columns to yield, in this order (None: all, in column order).
            num_epochs: how many epochs it may run (-1: unlimited); a loop after the last
                one raises RuntimeError (MindSpore: "fetch data beyond the specified number of
                epochs").
            output_numpy: yield NumPy arrays instead of tensors.

        Returns:
            An iterator of tuples.

        Example:
            >>> it = ds.create_tuple_iterator(num_epochs=2)
            >>> for epoch in range(2):
            ...     for image, label in it: ...
        """
        picks = self._column_indices(columns)
        return EpochIterator(self, num_epochs, lambda row: pick(row, picks, output_numpy))

    def create_dict_iterator(
        self, num_epochs: int = -1, output_numpy: bool = False
    ) -> EpochIterator:
        """Like `create_tuple_iterator`, yielding ``{column name: tensor}`` dicts.

        Example:
            >>> next(iter(ds.create_dict_iterator()))["label"]
        """
        names = self._spec.names

        def as_dict(row: Row) -> dict[str, Any]:
            return dict(zip(names, pick(row, range(len(names)), output_numpy), strict=True))

        return EpochIterator(self, num_epochs, as_dict)

    def _column_indices(self, columns: Sequence[str] | None) -> list[int]:
        if columns is None:
            return list(range(len(self._spec.names)))
        cols = [columns] if isinstance(columns, str) else list(columns)
        unknown = [c for c in cols if c not in self._spec.names]
        if unknown:
            raise ValueError(
                f"unknown column(s) {unknown}; the columns are {list(self._spec.names)}"
            )
        return [self._spec.names.index(c) for c in cols]


DEFAULT_SEED = 5489
"""MindSpore's dataset seed until one is set (``std::mt19937``'s default seed)."""


def pipeline_seed() -> int:
    """The seed a source dataset takes when created: torch's, once the script seeded it
    (`context.torch_seeded`), else `DEFAULT_SEED`, the same in every process (an unseeded
    job's ranks would otherwise each shuffle by their own random seed, and their shards
    overlap)."""
    return torch.initial_seed() if torch_seeded() else DEFAULT_SEED


def source_spec(
    source: Source,
    names: Sequence[str],
    *,
    shuffle: bool,
    num_samples: int | None,
    shard: ShardSetting,
    workers: int,
    label: str,
) -> _Spec:
    """The `_Spec` of a freshly created source dataset (seed: `pipeline_seed`)."""
    order = EpochOrder(seed=pipeline_seed(), shuffle_source=shuffle, num_samples=num_samples)
    return _Spec(source, tuple(names), order, shard, workers=workers, trail=(label,))
