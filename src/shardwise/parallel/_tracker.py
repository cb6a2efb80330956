"""Per-call bookkeeping of the semi_auto runtime: the layout state of every activation.

A tracked tensor's state is one of:

- a `TensorLayout` on the plan's global matrix (the output of a shardwise primitive);
- ``"dp"``: data parallel, dim 0 split over every rank in rank order (this rank holds rows
  ``[r * b, (r + 1) * b)`` of the global tensor); the network inputs and the outputs of
  unannotated torch ops;
- ``"rep"``: the whole tensor on every rank (a reduced value such as the loss, or a
  ``full_batch`` input).

Tensors that are not tracked (parameters of unannotated modules, constants) are whole on every
rank, like ``"rep"``.
"""

from __future__ import annotations

from typing import Literal

import torch

from shardwise.layout import DeviceMatrix, TensorLayout, refine
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._runtime import data_parallel_layout, replicated_layout

Shape = tuple[int, ...]
State = TensorLayout | Literal["dp", "rep"]


class Tracker:
    """State and global shape of every tensor produced during one wrapped call, keyed by id (the
    tensor is kept so that its id is not reused before `clear`)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.Tensor, State, Shape]] = {}
        self.batch: dict[int, torch.Tensor] = {}  # ``full_batch`` inputs (whole, ``"rep"``)

    def put_batch(self, t: torch.Tensor) -> None:
        """Track a ``full_batch`` input: whole on every rank (``"rep"``), and an unannotated
        torch op takes this rank's rows of it (`DataParallelOps`)."""
        self.put(t, "rep", tuple(int(s) for s in t.shape))
        self.batch[id(t)] = t

    def put(self, t: torch.Tensor, state: State, shape: Shape) -> None:
        self._seen[id(t)] = (t, state, shape)

    def find(self, t: torch.Tensor) -> tuple[State, Shape] | None:
        """The state and global shape of `t`, or None if it is not tracked."""
        found = self._seen.get(id(t))
        if found is None or found[0] is not t:
            return None
        return found[1], found[2]

    def get(self, t: torch.Tensor, who: str) -> tuple[State, Shape]:
        found = self.find(t)
        if found is None:
            raise UnsupportedParallelError(
                f"{who}: an input was not produced by a shardwise primitive, a supported torch "
                f"op or the wrapped call's inputs (constants made inside the network are not "
                f"supported as primitive inputs)"
            )
        return found

    def states(self) -> list[tuple[State, Shape]]:
        """The state and global shape of every tracked tensor."""
        return [(state, shape) for _, state, shape in self._seen.values()]

    def clear(self) -> None:
        self._seen.clear()
        self.batch.clear()


def layout_of(state: State, matrix: DeviceMatrix, ndim: int) -> TensorLayout:
    """`state` as a layout on `matrix` (``"dp"``: dim 0 split over every axis; a layout on a
    coarser matrix, e.g. a dataset strategy's: refined onto `matrix`)."""
    if state == "dp":
        check_rank_order(matrix)
        return data_parallel_layout(matrix, ndim)
    if state == "rep":
        return replicated_layout(matrix, ndim)
    assert not isinstance(state, str)
    return state if state.matrix == matrix else refine(state, matrix)


def check_rank_order(matrix: DeviceMatrix) -> None:
    """``"dp"`` rows go to ranks in rank order: `matrix` must use the default rank_list."""
    if tuple(matrix.rank_list) != tuple(range(matrix.size)):
        raise UnsupportedParallelError(
            f"{matrix}: a custom rank_list is not supported with data-parallel activations "
            f"(unannotated torch ops, network inputs)"
        )


def input_matrices(tracker: Tracker) -> list[Shape]:
    """The device matrices of the tracked tensors that carry their own layout (inputs cut by a
    per-input dataset strategy, before any primitive ran)."""
    return [state.matrix.shape for state, _ in tracker.states() if not isinstance(state, str)]
