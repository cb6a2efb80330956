"""Where rows come from: random-access tables, and Python streams read into one per epoch.

- `to_tensor` / `to_row`: a user value / row (tuple, list, dict, single value) -> tensors.
- `TensorTable`: columns stacked in tensors (MNIST, or a stream whose rows have equal
  shapes); the fast path: a batch of rows is one indexing op per column (`stacked`).
- `RowTable`: a list of rows of varying shapes.
- `IndexableTable`: a user object with ``__getitem__`` and ``__len__``, read row by row.
- `StreamSource`: a generator function or iterable, read completely at the start of each epoch
  (`table`), so that shuffling and sharding can address its rows by index; `row_count`
  reuses the last read (or reads once) to answer ``len()``.
- `make_source`: picks one of the above for ``GeneratorDataset(source)``; a torch
  ``IterableDataset`` (or an object whose ``__getitem__`` is torch's unimplemented base one)
  is a stream even when it defines ``__len__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import IterableDataset

Row = tuple[torch.Tensor, ...]


def to_tensor(value: Any, where: str) -> torch.Tensor:
    """A tensor from a tensor, NumPy array, number or nested list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, str | bytes):
        raise TypeError(f"{where}: strings are not supported as column values; encode them")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"{where}: cannot turn a {type(value).__name__} into a tensor; yield tensors, NumPy "
            "arrays or numbers"
        ) from e


def to_row(value: Any, names: Sequence[str], where: str) -> Row:
    """One row as a tuple of tensors, one per column name.

    A tuple (or, for several columns, a list) is the row; a dict is looked up by column name;
    anything else is the single column's value.
    """
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(
                f"{where}: the row dict lacks column(s) {missing}; it has {list(value)}"
            )
        values: Sequence[Any] = [value[n] for n in names]
    elif isinstance(value, tuple) or (isinstance(value, list) and len(names) > 1):
        values = value
    else:
        values = (value,)
    if len(values) != len(names):
        raise ValueError(
            f"{where}: the row has {len(values)} value(s) but column_names has {len(names)} "
            f"({list(names)}); yield one value per column, as a tuple"
        )
    return tuple(to_tensor(v, f"{where}, column {n!r}") for v, n in zip(values, names, strict=True))


class Table:
    """Rows addressable by index; `stacked` is the vectorized fetch where supported."""

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, indices: Sequence[int]) -> list[Row]:
        """The rows at `indices`, one tuple of tensors each."""
        raise NotImplementedError

    def stacked(self, indices: torch.Tensor) -> Row | None:
        """The rows at `indices` stacked per column, or None when rows cannot be stacked."""
        return None


_NO_INDEX_SELECT = (torch.uint16, torch.uint32, torch.uint64)


def _take(column: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` of `column`: ``index_select`` copies whole rows (an MNIST batch in ~10 us,
    where ``column[indices]`` gathers byte by byte); it lacks the wide unsigned dtypes."""
    if column.dtype in _NO_INDEX_SELECT:
        return column[indices]
    return column.index_select(0, indices)


class TensorTable(Table):
    """Columns held as tensors whose dim 0 indexes the rows."""

    def __init__(self, columns: Sequence[torch.Tensor]) -> None:
        self.columns = tuple(columns)
        lengths = {len(c) for c in self.columns}
        if len(lengths) > 1:
            raise ValueError(f"TensorTable: columns have different lengths {sorted(lengths)}")

    def __len__(self) -> int:
        return len(self.columns[0]) if self.columns else 0

    def rows(self, indices: Sequence[int]) -> list[Row]:
        return [tuple(c[i] for c in self.columns) for i in indices]

    def stacked(self, indices: torch.Tensor) -> Row | None:
        return tuple(_take(c, indices) for c in self.columns)


class RowTable(Table):
    """Rows held in a list (their shapes may differ)."""

    def __init__(self, rows: list[Row]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, indices: Sequence[int]) -> list[Row]:
        return [self._rows[i] for i in indices]


class IndexableTable(Table):
    """A user object with ``__getitem__(int)`` and ``__len__``, converted row by row."""

    def __init__(self, obj: Any, names: Sequence[str]) -> None:
        self.obj, self.names = obj, tuple(names)

    def __len__(self) -> int:
        return len(self.obj)

    def rows(self, indices: Sequence[int]) -> list[Row]:
        return [to_row(self.obj[i], self.names, f"GeneratorDataset source[{i}]") for i in indices]


def table_from_rows(rows: list[Row]) -> Table:
    """A `TensorTable` when every column stacks (equal shapes and dtypes), else a `RowTable`."""
    if not rows:
        return RowTable(rows)
    try:
        return TensorTable([torch.stack(col) for col in zip(*rows, strict=True)])
    except RuntimeError:
        return RowTable(rows)


class StreamSource:
    """A generator function or iterable, read into a `Table` once per epoch.

    A generator function (any callable) is called again for every epoch, as MindSpore does;
    a re-iterable object (list, custom iterable) is iterated again; a one-shot iterator (a
    generator object) is read once and its rows are reused for later epochs.
    """

    def __init__(self, source: Callable[[], Iterable[Any]] | Iterable[Any], names: Sequence[str]):
        self.source, self.names = source, tuple(names)
        # the last rows read, and the epoch that used them (None: read only to count them)
        self._cached: tuple[int | None, Table] | None = None
        self._one_shot = not callable(source) and iter(source) is source

    def _read(self) -> Table:
        it = self.source() if callable(self.source) else iter(self.source)
        rows = [to_row(v, self.names, f"GeneratorDataset row {i}") for i, v in enumerate(it)]
        return table_from_rows(rows)

    def table(self, epoch: int) -> Table:
        """The rows of `epoch`: read now, or the rows already read for it (or for counting)."""
        if self._cached is not None:
            used_by, table = self._cached
            if self._one_shot or used_by is None or used_by == epoch:
                self._cached = (epoch, table)
                return table
        table = self._read()
        self._cached = (epoch, table)
        return table

    def count(self) -> int:
        """Rows per epoch: those of the last read, or a fresh read kept for the next epoch."""
        if self._cached is None:
            self._cached = (None, self._read())
        return len(self._cached[1])


Source = Table | StreamSource


def _is_torch_stream(source: Any) -> bool:
    """Whether `source` is a torch ``IterableDataset``, or an iterable whose ``__getitem__`` is
    torch ``Dataset``'s base one (which raises NotImplementedError): read as a stream."""
    if isinstance(source, IterableDataset):
        return True
    getitem = getattr(type(source), "__getitem__", None)
    return getitem is TorchDataset.__getitem__ and isinstance(source, Iterable)


def make_source(source: Any, names: Sequence[str]) -> Source:
    """The `Source` for ``GeneratorDataset(source, column_names)``.

    Raises:
        TypeError: `source` is neither indexable (``__getitem__`` + ``__len__``), callable nor
            iterable (a torch Dataset counts as indexable only with its own ``__getitem__``).
    """
    if isinstance(source, list | tuple) or _is_torch_stream(source):
        return StreamSource(source, names)
    if getattr(type(source), "__getitem__", None) is TorchDataset.__getitem__:
        raise TypeError(
            f"GeneratorDataset: source {type(source).__name__} is a torch Dataset that implements "
            "neither __getitem__ nor __iter__; define __getitem__ (with __len__) or __iter__"
        )
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        return IndexableTable(source, names)
    if callable(source) or isinstance(source, Iterable):
        return StreamSource(source, names)
    raise TypeError(
        f"GeneratorDataset: source must be a generator function, an iterable or an object with "
        f"__getitem__ and __len__; got {type(source).__name__}"
    )


def table_for(source: Source, epoch: int) -> Table:
    """The table a pipeline reads in `epoch`."""
    return source.table(epoch) if isinstance(source, StreamSource) else source


def row_count(source: Source) -> int:
    """Rows per epoch (a stream that was never read is read once to count them)."""
    return source.count() if isinstance(source, StreamSource) else len(source)
