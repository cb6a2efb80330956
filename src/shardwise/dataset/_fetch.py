"""Turning a list of indices into finished rows or batches: the work a loader worker does.

- `MapStep`: one ``map(operations, input_columns)`` call; `MapStep.apply` runs its ops on
  stacked columns (``batched=True``, vectorized) or on one row.
- `stack_rows`: rows -> one tensor per column, with a clear error for unequal shapes.
- `IndexBatch`: one step's indices and the torch seed its fetch runs under.
- `Fetcher`: the ``torch.utils.data.Dataset`` handed to ``DataLoader``; its ``__getitems__``
  reads a whole index batch from the table, runs the maps before ``batch()`` (vectorized when
  every op is a built-in `Transform` and the table stacks), stacks, then runs the maps after
  ``batch()``. An `IndexBatch` is fetched under a forked torch RNG seeded with its seed, so a
  random op (or a random ``__getitem__``) draws the same numbers in this process as in a
  worker process, and the caller's global RNG is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.random import fork_rng
from torch.utils.data import Dataset as TorchDataset

from shardwise.dataset._sources import Row, Table, to_tensor
from shardwise.dataset.transforms import Transform

Op = Callable[..., Any]


@dataclass(frozen=True)
class MapStep:
    """The operations of one ``map`` call and the indices of the columns they read and write."""

    ops: tuple[Op, ...]
    columns: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def vectorized(self) -> bool:
        """Whether every op can run on a stack of samples (built-in transforms can)."""
        return all(isinstance(op, Transform) for op in self.ops)

    def _call(self, op: Op, values: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
        if isinstance(op, Transform):
            return [op.apply_batch(v) if batched else op(v) for v in values]
        out = op(*values)
        if isinstance(out, tuple) or (isinstance(out, list) and len(values) > 1):
            outs = out
        else:
            outs = (out,)
        if len(outs) != len(values):
            raise ValueError(
                f"map: {op!r} returned {len(outs)} value(s) for the {len(values)} input column(s) "
                f"{list(self.names)}; return one value per input column"
            )
        return [to_tensor(o, f"map: output of {op!r}") for o in outs]

    def apply(self, columns: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
        """Apply every op in order to the step's columns (a row, or stacked columns)."""
        values = [columns[c] for c in self.columns]
        for op in self.ops:
            values = self._call(op, values, batched)
        out = list(columns)
        for c, v in zip(self.columns, values, strict=True):
            out[c] = v
        return out


@dataclass(frozen=True)
class IndexBatch:
    """The source indices of one loader step and the torch seed its fetch draws from."""

    indices: torch.Tensor
    seed: int


def stack_rows(rows: Sequence[Row], names: Sequence[str]) -> Row:
    """Stack rows into one tensor per column.

    Raises:
        ValueError: a column whose rows differ in shape; the message names it.
    """
    out = []
    for c, name in enumerate(names):
        values = [r[c] for r in rows]
        try:
            out.append(torch.stack(values))
        except RuntimeError as e:
            shapes = sorted({tuple(v.shape) for v in values})
            raise ValueError(
                f"batch: column {name!r} has rows of different shapes {shapes[:4]}; make them "
                "equal with a map() before batch() (pad or crop)"
            ) from e
    return tuple(out)


class Fetcher(TorchDataset[Any]):
    """Reads index batches for ``DataLoader`` (``batch_sampler`` gives the index tensors).

    Returns a tuple of stacked columns when the pipeline batches, else a list of rows.
    """

    def __init__(
        self,
        table: Table,
        names: tuple[str, ...],
        sample_maps: tuple[MapStep, ...],
        batch_maps: tuple[MapStep, ...],
        batched: bool,
    ) -> None:
        self.table, self.names, self.batched = table, names, batched
        self.sample_maps, self.batch_maps = sample_maps, batch_maps

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> Row | list[Row]:
        return self.__getitems__(torch.tensor([index]))

    def _stacked_prefix(self, indices: torch.Tensor) -> tuple[Row | None, int]:
        """Stacked columns after the leading vectorizable maps, and how many maps ran."""
        stacked = self.table.stacked(indices)
        if stacked is None:
            return None, 0
        cols, done = list(stacked), 0
        for step in self.sample_maps:
            if not step.vectorized:
                break
            cols, done = step.apply(cols, batched=True), done + 1
        return tuple(cols), done

    def __getitems__(self, indices: IndexBatch | torch.Tensor | Sequence[int]) -> Row | list[Row]:
        if not isinstance(indices, IndexBatch):
            return self._fetch(torch.as_tensor(indices, dtype=torch.int64))
        # (CPU only: ``torch.manual_seed`` would also reseed, and not restore, CUDA's RNG)
        with fork_rng(devices=[]):
            torch.default_generator.manual_seed(indices.seed)
            return self._fetch(indices.indices)

    def _fetch(self, idx: torch.Tensor) -> Row | list[Row]:
        stacked, done = self._stacked_prefix(idx)
        rest = self.sample_maps[done:]
        if stacked is not None and not rest:
            if not self.batched:
                return list(zip(*(c.unbind(0) for c in stacked), strict=True))
            return self._after_batch(stacked)
        if stacked is not None:
            rows = list(zip(*(c.unbind(0) for c in stacked), strict=True))
        else:
            rows = self.table.rows(idx.tolist())
        for step in rest:
            rows = [tuple(step.apply(list(r), batched=False)) for r in rows]
        if not self.batched:
            return rows
        return self._after_batch(stack_rows(rows, self.names))

    def _after_batch(self, batch: Row) -> Row:
        cols = list(batch)
        for step in self.batch_maps:
            cols = step.apply(cols, batched=True)
        return tuple(cols)


def identity_collate(batch: Any) -> Any:
    """``collate_fn`` for `Fetcher`: its batches are already collated."""
    return batch
