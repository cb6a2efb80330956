"""What a wrapped train step returns besides its loss, and what runs on it after the plan.

A train step is captured only up to its first ``loss.backward()``, so the plan does not know
which of its values the step returns (a ``(loss, logits)`` pair, a detached activation). Every
value leaves as a wrapped network's outputs do: this rank's rows (the whole value under
``"full_batch"``, for a 0-d value, or when the rows do not divide by the ranks), whatever the
plan holds it as (a partial sum, a split over the model-parallel axis, rows of the data-parallel
axis only).

- `convention`: the placement a returned value of a global shape leaves in.
- `leave_edges`: per node, the edges that move those of its outputs held otherwise to the
  convention (worked out once per plan, with `_node_table.NodeTable`).
- `Leaving` (mixed into `_executor.PlanExecutor`): `Leaving.note_placed` keeps a weak reference
  to each such output as its op makes it; `Leaving.step_outputs` moves the returned ones at the
  end of the call; `Leaving.check_placed` runs before every op after the plan ended (after
  ``loss.backward()``, on this rank's blocks): an elementwise op on such values alone gives a
  value held the same way (``logits.detach()``, ``h.float() * 2``), any other op reading one is
  refused with `UnsupportedParallelError` (``logits.argmax(-1)`` on a vocabulary split would
  compare this rank's columns only), and so is a read of its value (``item``, ``tolist``;
  printing it shows this rank's block) (`Leaving.placed_call`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.layout import DeviceMatrix
from shardwise.parallel._edges import move
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._passes import _elementwise
from shardwise.planner import EdgePlan, ParallelPlan, Placed
from shardwise.planner._placed import replicated
from shardwise.planner._placement import data_parallel
from shardwise.redistribution import plan_redistribution

T = torch.Tensor
_PRINTS = ("__repr__", "__str__", "__format__")  # (value reads that only show the block)
Placings = dict[int, tuple[weakref.ref[T], EdgePlan, str]]  # id -> (tensor, edge, its node)


def convention(matrix: DeviceMatrix, shape: tuple[int, ...], dataset: object) -> Placed:
    """How a value of global `shape` leaves a wrapped call: this rank's rows, or whole under
    ``"full_batch"``, when 0-d, or when the ranks do not divide its rows."""
    ndim = len(shape)
    whole = dataset == "full_batch" or ndim == 0 or shape[0] % matrix.size
    return replicated(matrix, ndim) if whole else data_parallel(matrix, ndim)


def leave_edges(plan: ParallelPlan, dataset: object) -> list[dict[int, EdgePlan] | None]:
    """Per node: its outputs (by tensor index) that the plan holds other than `convention`
    says, each with the edge that moves it there (None: every output leaves as it is)."""
    after = {e.value: e.dst for e in plan.edges if e.consumer == -1}  # (a loss, made whole)
    out: list[dict[int, EdgePlan] | None] = []
    for n in plan.nodes:
        edges: dict[int, EdgePlan] = {}
        for i, (placed, shape) in enumerate(zip(n.outputs, n.shapes, strict=True)):
            value = f"%{n.index}" + (f".{i}" if i else "")
            src = after.get(value, placed)
            want = convention(plan.matrix, tuple(shape), dataset)
            if src == want:
                continue
            steps = plan_redistribution(src.layout, want.layout, shape).steps
            edges[i] = EdgePlan(-1, i, value, shape, src, want, steps)
        out.append(edges or None)
    return out


def _tensors(out: Any) -> list[T]:
    return [out] if isinstance(out, T) else [t for t in pytree.tree_leaves(out) if isinstance(t, T)]


class Leaving:
    """Values held other than they leave (see the module docstring); `PlanExecutor` sets
    `placed` (per call) and reads `leaving` from its `NodeTable`."""

    placed: Placings
    plan: ParallelPlan

    def note_placed(self, k: int, edges: dict[int, EdgePlan], out: Any) -> None:
        """Node `k` made `out`: keep its outputs that `edges` move when returned."""
        name = self.plan.nodes[k].name
        for i, t in enumerate(_tensors(out)):
            edge = edges.get(i)
            if edge is not None:
                self.placed[id(t)] = (weakref.ref(t), edge, f"%{k} {name}")

    def _held(self, t: Any) -> tuple[EdgePlan, str] | None:
        entry = self.placed.get(id(t)) if isinstance(t, T) else None
        if entry is None or entry[0]() is not t:
            return None
        return entry[1], entry[2]

    def step_outputs(self, out: Any) -> Any:
        """The train step's returned `out`, each tensor the plan made as `convention` says."""
        if not self.placed:
            return out
        leaves, spec = pytree.tree_flatten(out)
        for i, leaf in enumerate(leaves):
            held = self._held(leaf)
            if held is not None:
                leaves[i] = move(leaf, held[0])
        return pytree.tree_unflatten(leaves, spec)

    def placed_call(
        self, func: Callable[..., Any], kind: str, op: str, args: Any, kwargs: Any
    ) -> Any:
        """A value read (``item``, ``tolist``: refused on a value held otherwise, printing
        is not) or an alias (``contiguous``) after the plan ended."""
        if kind == "read" and not op.endswith(_PRINTS):
            self.check_placed(op, (args, kwargs), None)
        out = func(*args, **kwargs)
        if kind == "alias":
            self.check_placed(op, (args, kwargs), out)
        return out

    def check_placed(self, op: str, args: Any, out: Any) -> None:
        """After `op` ran outside the plan on `args`: an elementwise op whose every non-scalar
        tensor input is held the same way makes `out` held so too; any other op reading such a
        value is refused (it computed on this rank's block of it)."""
        if not self.placed:
            return
        leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, T)]
        held = [(t, self._held(t)) for t in leaves]
        first = next((h for _, h in held if h is not None), None)
        if first is None:
            return
        shape = next(t.shape for t, h in held if h is not None)
        alike = all(h is not None and h[0].src == first[0].src for t, h in held if t.dim() > 0)
        if _elementwise(op) and alike and isinstance(out, T) and out.shape == shape:
            self.placed[id(out)] = (weakref.ref(out), first[0], first[1])
            return
        edge, node = first
        raise UnsupportedParallelError(
            f"AutoParallel: {op} after loss.backward() reads the output of {node}, which the "
            f"plan holds as {edge.src} (not this rank's rows of it), so it would compute on "
            f"this rank's part of it only; compute it before loss.backward() (the plan then "
            f"includes it), or return the tensor from the step (it leaves as this rank's "
            f"rows) and compute on it after the call"
        )
