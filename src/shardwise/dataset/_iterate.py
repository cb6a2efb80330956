"""Iterators over several epochs (MindSpore's ``create_tuple_iterator`` semantics).

- `EpochIterator`: re-iterable; each ``for`` loop over it runs the dataset's next epoch, up to
  ``num_epochs``; asking for a row after the last epoch is a RuntimeError, as in MindSpore.
- `pick`: selects (and optionally converts to NumPy) the columns of one row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from shardwise.dataset._args import as_int
from shardwise.dataset._sources import Row


class _Epochs(Protocol):
    def _next_epoch(self) -> Iterator[Row]: ...


def pick(row: Row, picks: Sequence[int], output_numpy: bool) -> tuple[Any, ...]:
    """The columns `picks` of `row`, as NumPy arrays when `output_numpy`."""
    return tuple(row[i].numpy() if output_numpy else row[i] for i in picks)


class EpochsDone(RuntimeError, ValueError):
    """A row asked of an iterator after its ``num_epochs`` epochs (MindSpore raises a
    RuntimeError there; a ValueError too, as shardwise's user errors)."""


class EpochIterator:
    """Iterates a `Dataset` epoch after epoch; one ``for`` loop = one epoch."""

    def __init__(self, dataset: _Epochs, num_epochs: int, convert: Callable[[Row], Any]) -> None:
        epochs = as_int(num_epochs)
        if epochs is None or epochs < -1 or epochs == 0:
            raise ValueError(f"num_epochs={num_epochs!r} must be -1 (unlimited) or an int >= 1")
        self._dataset, self._num_epochs, self._convert = dataset, epochs, convert
        self._current: Iterator[Row] | None = None
        self._started = 0

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._current is None:
            if 0 <= self._num_epochs <= self._started:
                raise EpochsDone(
                    f"the iterator's {self._num_epochs} epoch(s) (num_epochs={self._num_epochs}) "
                    "are done: no more rows. Fix: create the iterator with num_epochs equal to "
                    "the epochs the loop runs, or -1 (unlimited)"
                )
            self._current = self._dataset._next_epoch()
            self._started += 1
        try:
            return self._convert(next(self._current))
        except StopIteration:
            self._current = None
            raise
