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
- `buffer_edges`: per node, its outputs a buffer is re-assigned to (``self.rm = 0.9 * self.rm
  + 0.1 * h.mean(0)``: `ParallelPlan.set_buffers`), each with the edge that makes it whole, as
  buffers are stored; `Leaving.store_buffers` puts the moved value in the buffer at the end of
  the call and before a later pass of the plan (gradient accumulation), so every rank holds
  one device's buffer.
- `Leaving` (mixed into `_executor.PlanExecutor`): `Leaving.note_placed` keeps a weak reference
  to each such output as its op makes it (`Leaving.note_inputs`: under ``"full_batch"`` each
  input cut to this rank's rows at entry too); `Leaving.step_outputs` moves the returned ones at the
  end of the call (in tuples, lists, dicts, registered and plain dataclasses; a tensor returned
  twice is moved once); `Leaving.check_placed` runs on every op after the plan ended (after
  ``loss.backward()``, on this rank's blocks) that reads such a value: an op right on this
  rank's part gives a value held the same way (`_keeps`: an elementwise op on blocks of a split,
  a parameter the plan stores as such a block counting as held so (`Leaving._stored`: an EMA
  updated with the weights);
  on a partial sum only a linear one, ``detach``, ``* 2``, ``/ 4``, a sum of partial sums, a
  widening cast); an op on whole values, or one that reads only the shape (``zeros_like``),
  runs as it is; any other, a move to another device and a read of the value (``item``,
  ``tolist``; printing shows this rank's part) are refused with `UnsupportedParallelError`
  (``logits.argmax(-1)`` on a vocabulary split would compare this rank's columns only,
  ``out + 1`` on a partial sum would add 1 on every rank) (`Leaving.placed_call`).
- `Leaving.note_fill`: a fill the plan makes whole where the step's code sized it as this
  rank's rows (``torch.ones(x.shape[0], 1)``, ``x.new_ones(x.shape[0], 1)``, a GAN's
  target) is read by an op after the plan ended as those rows (`Leaving.fill_rows`), as the
  code made them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise._torch import pytree
from shardwise._torch.module_state import own_buffers
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
    after = _losses(plan)
    out: list[dict[int, EdgePlan] | None] = []
    for n in plan.nodes:
        edges: dict[int, EdgePlan] = {}
        for i, (placed, shape) in enumerate(zip(n.outputs, n.shapes, strict=True)):
            value = f"%{n.index}" + (f".{i}" if i else "")
            want = convention(plan.matrix, tuple(shape), dataset)
            edge = _edge_to(after.get(value, placed), want, value, i, shape)
            if edge is not None:
                edges[i] = edge
        out.append(edges or None)
    return out


def _losses(plan: ParallelPlan) -> dict[str, Placed]:
    """A loss's value -> the placement its loss edge leaves it in (whole)."""
    return {e.value: e.dst for e in plan.edges if e.consumer == -1}


def _edge_to(
    src: Placed, want: Placed, value: str, index: int, shape: tuple[int, ...]
) -> EdgePlan | None:
    """The edge moving `value` (its node's output `index`, of global `shape`) from `src` to
    `want`; None when it is there already."""
    if src == want:
        return None
    steps = plan_redistribution(src.layout, want.layout, shape).steps
    return EdgePlan(-1, index, value, shape, src, want, steps)


BufferMoves = dict[int, list[tuple[int, str, EdgePlan]]]  # node -> (output, buffer, edge)


def buffer_edges(plan: ParallelPlan) -> BufferMoves:
    """Per node: each of its outputs that `ParallelPlan.set_buffers` puts in a buffer and the
    plan holds other than whole, with the buffer's name and the edge that makes it whole."""
    after = _losses(plan)
    out: BufferMoves = {}
    for name, value in plan.set_buffers.items():
        k, _, i = value.removeprefix("%").partition(".")
        node, index = plan.nodes[int(k)], int(i or 0)
        shape = node.shapes[index]
        want = replicated(plan.matrix, len(shape))
        edge = _edge_to(after.get(value, node.outputs[index]), want, value, index, shape)
        if edge is not None:
            out.setdefault(int(k), []).append((index, name, edge))
    return out


def _tensors(out: Any) -> list[T]:
    return [out] if isinstance(out, T) else [t for t in pytree.tree_leaves(out) if isinstance(t, T)]


class Leaving:
    """Values held other than they leave (see the module docstring); `PlanExecutor` sets
    `placed` (per call) and reads `leaving` from its `NodeTable`."""

    placed: Placings
    plan: ParallelPlan
    buffer_moves: BufferMoves  # (`buffer_edges`, per plan)
    buffer_made: dict[str, tuple[weakref.ref[T], EdgePlan]]  # buffer -> its value of this call
    network: nn.Module | None  # (whose buffers `set_buffers` names)
    params_of: Callable[[], dict[int, str]]
    param_value: Callable[[torch.Tensor], torch.Tensor] | None
    fills: dict[int, tuple[weakref.ref[T], EdgePlan, T | None]]  # (`note_fill`) -> its rows
    made_outside: dict[int, weakref.ref[T]]  # (`_passes`)
    paused: int

    if TYPE_CHECKING:

        def current(self, t: Any) -> Any: ...

    def note_placed(self, k: int, edges: dict[int, EdgePlan], out: Any) -> None:
        """Node `k` made `out`: keep its outputs that `edges` move when returned."""
        name = self.plan.nodes[k].name
        tensors = _tensors(out)
        for i, t in enumerate(tensors):
            edge = edges.get(i)
            if edge is not None:
                self.placed[id(t)] = (weakref.ref(t), edge, f"%{k} {name}")
        for i, buffer, edge in self.buffer_moves.get(k, ()):
            self.buffer_made[buffer] = (weakref.ref(tensors[i]), edge)

    def note_inputs(self, cuts: list[tuple[T, T, EdgePlan]]) -> None:
        """``full_batch``: keep each input the plan cut to this rank's rows at entry (rows,
        the caller's tensor, the entry edge), which leaves whole: returned, or read by an op
        after the plan ended, it is watched as an output of the plan's is."""
        for rows, _, edge in cuts:
            back = _edge_to(edge.dst, edge.src, edge.value, 0, edge.shape)
            if back is not None:
                name = edge.value.removeprefix("input:")
                self.placed[id(rows)] = (weakref.ref(rows), back, f"the step's input {name}")

    def store_buffers(self) -> None:
        """Each buffer re-assigned to a value the plan holds other than whole (`buffer_edges`)
        gets that value made whole, as one device's buffer (when it still holds the value)."""
        made, self.buffer_made = self.buffer_made, {}
        if self.network is None:
            return
        for buffer, (ref, edge) in made.items():
            path, _, attr = buffer.rpartition(".")
            module = self.network.get_submodule(path)
            table, value = own_buffers(module), ref()
            held = table.get(attr)
            if held is None or value is None:
                continue
            if held is value or held is self.current(value):  # (identity: not values)
                table[attr] = move(self.current(held), edge)

    def note_fill(
        self, edges: dict[int, EdgePlan], asked: tuple[int, ...] | None, out: Any
    ) -> None:
        """A fill the plan made whole (`out`) where the step's code asked for `asked`, this
        rank's rows of it (``torch.ones(x.shape[0], 1)`` with this rank's ``x``: the plan gave
        it the global sizes); `edges` move it to those rows. Read by an op outside the plan
        (after ``loss.backward()``), it is those rows (`fill_rows`), as the code made them."""
        edge = edges.get(0)
        if edge is None or asked is None or not isinstance(out, T) or out.shape == asked:
            return
        whole = not edge.src.partial and not edge.src.layout.used_axes()
        if whole and not edge.dst.partial and edge.dst.local_shape(edge.shape) == asked:
            self.fills[id(out)] = (weakref.ref(out), edge, None)

    def fill_rows(self, args: Any) -> Any:
        """`args` of an op outside the plan with each fill `note_fill` kept as this rank's rows
        of it (cut once per call; the rows count as made outside the plan: no later pass reads
        them)."""
        if not self.fills:
            return args

        def rows(t: Any) -> Any:
            entry = self.fills.get(id(t)) if isinstance(t, T) else None
            whole = None if entry is None else entry[0]()
            if entry is None or whole is None or whole is not t:
                return t
            ref, edge, cut = entry
            if cut is None:
                self.paused += 1  # (the cut's own tensor calls are no ops of the step)
                try:
                    cut = move(whole, edge)
                finally:
                    self.paused -= 1
                self.fills[id(t)] = (ref, edge, cut)
                self.made_outside[id(cut)] = weakref.ref(cut)
            return cut

        return pytree.tree_map(rows, args)

    def _held(self, t: Any) -> tuple[EdgePlan, str] | None:
        entry = self.placed.get(id(t)) if isinstance(t, T) else None
        if entry is None or entry[0]() is not t:
            return None
        return entry[1], entry[2]

    def _stored(self, t: T) -> tuple[EdgePlan, str] | None:
        """A parameter stored as a block by the plan, held as that block (an EMA of the
        weights updated with it after the step: ``ema.add_(p)``); None for anything else,
        and under optimizer parallel (the parameter then holds a shard)."""
        name = self.params_of().get(id(t)) if self.param_value is None else None
        param = None if name is None else self.plan.params.get(name)
        if param is None or not param.layout.used_axes():
            return None
        placed = Placed(param.layout)
        return EdgePlan(-1, 0, f"param:{name}", param.shape, placed, placed), f"parameter {name}"

    def step_outputs(self, out: Any) -> Any:
        """The train step's returned `out`, each tensor the plan made as `convention` says (a
        tensor returned twice moved once; a plain dataclass's fields too)."""
        if not self.placed:
            return out
        done: dict[int, T] = {}

        def leave(x: Any) -> Any:
            x = self.current(x)  # (changed in place in a moved copy: that copy)
            fill = self.fills.get(id(x)) if self.fills else None
            if fill is not None and fill[0]() is x and fill[2] is not None:
                return fill[2]  # (read outside the plan: those rows, as changed there)
            held = self._held(x)
            if held is None:
                return x
            if id(x) not in done:
                done[id(x)] = move(x, held[0])
            return done[id(x)]

        return pytree.tree_map_dataclasses(leave, out)

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
        """After `op` ran outside the plan on `args` (see the module docstring): `out` held as
        its inputs are when the op is right on this rank's part of them (`_keeps`), nothing
        when they are whole values or it only reads their shape, else refused."""
        if not self.placed:
            return
        held = [(t, self._held(t)) for t in pytree.tree_leaves(args) if isinstance(t, T)]
        marks = [h for _, h in held if h is not None]
        if not marks or _name(op) in _SHAPE_ONLY:
            return
        held = [(t, h if h is not None else self._stored(t)) for t, h in held]
        edge, node = marks[0]
        moved = isinstance(out, T) and any(out.device != t.device for t, h in held if h)
        if not moved and _keeps(op, args, held, out):
            assert isinstance(out, T)
            self.placed[id(out)] = (weakref.ref(out), edge, node)
            return
        if not moved and all(not e.src.partial and not e.src.layout.used_axes() for e, _ in marks):
            return  # (whole values: the op is right on every rank)
        what = "moves it to another device" if moved else "would compute on this rank's part of it"
        raise UnsupportedParallelError(
            f"AutoParallel: {op} after loss.backward() reads the output of {node}, which the "
            f"plan holds as {edge.src} (not this rank's rows of it), so it {what} only; "
            f"compute it before loss.backward() (the plan then includes it), or return the "
            f"tensor from the step (it leaves as this rank's rows) and compute on it after the "
            f"call"
        )


def _name(op: str) -> str:
    """``torch.Tensor.mul_`` -> ``mul``; ``torch.Tensor.data.__get__`` -> ``data``."""
    return op.removesuffix(".__get__").rsplit(".", 1)[-1].strip("_")


def _keeps(op: str, args: Any, held: list[tuple[T, Any]], out: Any) -> bool:
    """Whether `op` on `held` (tensor, its mark or None) gives `out` held as they are: every
    non-0-d tensor input held alike and `out` shaped as one of them; on partial sums only a
    linear op (a sum of the ranks' results is the result of their sum)."""
    marks = [h for _, h in held if h is not None]
    src = marks[0][0].src
    if not isinstance(out, T) or any(h is None or h[0].src != src for t, h in held if t.dim()):
        return False
    if not any(out.shape == t.shape for t, h in held if h is not None):
        return False
    if not src.partial:
        return _elementwise(op)
    name = _name(op)
    numbers = [x for x in pytree.tree_leaves(args) if isinstance(x, int | float)]
    tensors = [t for t, _ in held]
    if name in _LINEAR_COPIES:  # (a cast only to a floating type at least as wide)
        wide = all(out.dtype.itemsize >= t.dtype.itemsize for t, h in held if h is not None)
        return wide and (out.dtype.is_floating_point or out.dtype.is_complex)
    if name in ("real", "imag"):  # (a complex sum's parts: the sums of the parts)
        return True
    if name in ("mul", "rmul"):  # (by a number or a 0-d tensor)
        return len(marks) == 1
    if name in ("div", "true_divide", "truediv"):  # (the partial sum divided, by those)
        kwargs = args[1] if isinstance(args, tuple) and len(args) > 1 else {}
        rounded = isinstance(kwargs, dict) and kwargs.get("rounding_mode") is not None
        return (
            not rounded
            and len(marks) == 1
            and held[0][1] is not None
            and all(t.dim() == 0 for t in tensors[1:])
        )
    if name in ("add", "sub"):  # (of partial sums placed alike: no number, no 0-d tensor)
        return not numbers and all(h is not None for _, h in held)
    return False


_SHAPE_ONLY = {"ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like"}
_LINEAR_COPIES = {"detach", "data", "clone", "contiguous", "neg", "to", "float", "double"}
_LINEAR_COPIES |= {"type_as"}
