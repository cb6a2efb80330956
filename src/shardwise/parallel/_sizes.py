"""Numbers user code computes from a split tensor's local shape (`Sizes`, mixed into
`_executor.PlanExecutor`).

The capture runs the network on global shapes; on a rank, ``x.size(0)`` is this rank's block's
size. A number the network computes from it and passes to an op (``h.view(b, t, c)``,
``loss / x.size(0)``, ``cov / (z.shape[0] - 1)``, ``torch.tensor(float(n))``) is then not the
one a device running the whole batch computes. The captured call (`planner.Node.args`) holds
the global numbers, and the executor gives each op those where the call's own differ:

- `Sizes.sizes`: an op whose inputs are all whole: an int (or slice) that differed from the
  captured one the first time the plan ran the op came from a local shape (as below), and
  every call that passes that same one there gets the captured one (a later pass that changes
  it is refused); any other int that differs from the captured one (``table[n]``,
  ``h[:, :n]`` with `n` passed per call) plans the call again before its first backward
  (`_errors.Replan`: a plan per such int, found again by `_variants.known_variant`), and is
  this pass's after it (a micro-batch's index); each float as below.
- `Sizes.numbers`: an op on split inputs that is not a view (views take the plan's local sizes:
  `_node_table`): each int or float, and each slice (``h[:, : n // 2]``), as below. Such a
  node takes the full path in the plan's first call (`NodeTable.numbered`); one whose numbers
  all were the captured ones goes back to its short path (`NodeTable.checked`).
- `Sizes.factory_numbers`: a factory's numbers (``torch.tensor(x.size(0))``, a fill value), as
  below; `Sizes.factory_sizes`: a sized factory's ints that are shares of the captured ones
  (``torch.arange(b)``).

"As below": a number that differs from the captured one the first time the plan runs the node
is noted with its position (`NodeTable.shares`); that call and every later one that passes the
same number there get the captured one. That first run is in the call the plan was captured
from, which starts from the Python state the capture started from (`planner._user_state`:
counters, lists, random generators put back), so only a local shape makes a number differ
there. A number that changes from call to call (a loss weight, a step counter) is left as the
call has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch import pytree
from shardwise.parallel._errors import Replan, UnsupportedParallelError
from shardwise.planner import ParallelPlan

if TYPE_CHECKING:
    from shardwise.parallel._node_table import NodeTable


def _size(x: Any) -> bool:
    """Whether a call's argument may be a size (an int, a slice), not a tensor or a number."""
    return isinstance(x, slice) or (isinstance(x, int) and not isinstance(x, bool))


_CONTAINERS = (list, tuple, dict)


def flat_call(args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    """Whether no argument of a call is a pytree container (``h.view(b, t, c)``, nearly every
    call): its leaves are then its arguments, flattened and rebuilt without pytree."""
    nodes = pytree.SUPPORTED_NODES
    for a in args:
        if isinstance(a, _CONTAINERS) or type(a) in nodes:
            return False
    return not kw or not any(isinstance(a, _CONTAINERS) or type(a) in nodes for a in kw.values())


def flatten_call(args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten((args, kw))``: the leaves and a spec that two calls share when
    their structures are the same (a flat call's: its argument count and keywords)."""
    if flat_call(args, kw):
        return [*args, *kw.values()], (len(args), tuple(kw))
    return pytree.tree_flatten((args, kw))


def unflatten_call(leaves: list[Any], spec: Any) -> tuple[Any, Any]:
    """The call `flatten_call` flattened to `leaves` and `spec`."""
    if isinstance(spec, tuple):
        n, keys = spec
        return tuple(leaves[:n]), dict(zip(keys, leaves[n:], strict=True))
    out: tuple[Any, Any] = pytree.tree_unflatten(leaves, spec)
    return out


def _flatten(args: Any, kw: Any) -> tuple[list[Any], Any]:
    """A call's arguments flattened as the capture recorded them: a ``torch.Size`` argument
    (``torch.randn(h.shape)``) as the tuple of its ints."""
    args = tuple(tuple(a) if isinstance(a, torch.Size) else a for a in args)
    kw = {k: tuple(v) if isinstance(v, torch.Size) else v for k, v in kw.items()}
    return flatten_call(args, kw)


def _first_differences(
    noted: dict[int, tuple[tuple[int, Any], ...]],
    k: int,
    own: list[Any],
    global_: list[Any],
    at: Callable[[], list[int]],
) -> tuple[tuple[int, Any], ...]:
    """Node `k`'s arguments among positions `at()` whose value differed from the captured one
    the first time the plan ran the node, with that value (noted in `noted`, a `NodeTable`
    dict, on that first run)."""
    known = noted.get(k)
    if known is None:
        known = noted[k] = tuple((i, own[i]) for i in at() if own[i] != global_[i])
    return known


def _number(x: Any) -> bool:
    """Whether `x` is a Python int or float (not a bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def _with(own: list[Any], spec: Any, global_: list[Any], at: list[int]) -> tuple[Any, Any]:
    """The call's flat arguments `own` (of pytree `spec`) with the captured ones at `at`."""
    for i in at:
        own[i] = global_[i]
    return unflatten_call(own, spec)


class Sizes:
    """The executor's sizes and numbers (see the module docstring); `PlanExecutor` sets the
    attributes."""

    plan: ParallelPlan
    table: NodeTable
    backward_seen: bool

    def sizes(self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]) -> tuple[Any, Any]:
        """The arguments node `k` (on whole inputs) runs with: this call's, except its sizes
        (ints and slices) that came from a split tensor's local shape (``b, t, c = h.shape``:
        `_local_sizes`), which get the captured global ones, and its floats that differed in
        the plan's first call (`_shares`; other floats, a loss weight, are this call's). Any
        other size that differs from the captured one (``table[n]``, ``h[:, :n]`` with `n`
        passed per call) plans the call again before its first backward (`Replan`: the plan's
        shapes were worked out with the captured size); after it (a micro-batch's index) it is
        this pass's. Raises when a later pass changes a size that came from a local shape."""
        own, spec = _flatten(args, kw)
        global_, global_spec = flatten_call(*captured)
        if spec != global_spec:
            return args, kw
        floats = self._shares(k, own, global_, float)
        at = [i for i, x in enumerate(own) if _size(x)]
        local = self._local_sizes(k, own, global_, at)
        shares = [i for i, first in local if own[i] == first]
        other = [i for i in at if own[i] != global_[i] and i not in shares]
        if other:
            self._other_sizes(k, own, global_, at, other, local)
        if not shares and not floats:
            return args, kw
        return _with(own, spec, global_, [*shares, *floats])

    def _local_sizes(
        self, k: int, own: list[Any], global_: list[Any], at: list[int]
    ) -> tuple[tuple[int, Any], ...]:
        """The positions of node `k`'s sizes (at `at`) that came from a local shape, with the
        local size: those that differed from the captured one the first time the plan ran the
        node (in the call it was captured from, so from a local shape: the module docstring)."""
        return _first_differences(self.table.local_sizes, k, own, global_, lambda: at)

    def _other_sizes(
        self,
        k: int,
        own: list[Any],
        global_: list[Any],
        at: list[int],
        other: list[int],
        local: tuple[tuple[int, Any], ...],
    ) -> None:
        """Node `k`'s sizes at `other` differ from the captured ones and from the local sizes
        noted there (`_local_sizes`): `Replan` before the call's first backward (with this
        call's sizes, to find the plan captured with them: `_variants.known_variant`); after
        it, an error where a size from a local shape changed, else nothing (this pass's)."""
        node = self.plan.nodes[k]
        noted = {i for i, _ in local}
        if not self.backward_seen:
            mine = tuple((i, own[i]) for i in at if i not in noted)
            got = [own[i] for i in other]
            raise Replan(
                f"{node.op} (%{k} {node.name}) with sizes {got} where the plan has "
                f"{[global_[i] for i in other]}",
                k,
                node.op,
                sizes=mine,
            )
        if not noted.intersection(other):
            return
        raise UnsupportedParallelError(
            f"AutoParallel: {node.op} (%{k} {node.name}) got {[own[i] for i in at]} in this "
            f"pass and {[dict(local).get(i, global_[i]) for i in at]} in the first, computed "
            f"from a split tensor's local shape (the plan has {[global_[i] for i in at]}). "
            f"Micro-batches (gradient accumulation): split the whole batch with x.chunk(k) or "
            f"x.split(n), which run as each rank's share of every part, rather than slicing it "
            f"with bounds from its size (a global bound takes those rows of the global batch: "
            f"x[:8] of 16 rows is the first ranks' rows, not a part of each rank's; "
            f"docs/parallel.md, 'Gradient accumulation inside a step'). Other sizes: compute "
            f"them from global sizes (the step's own constants) instead"
        )

    def numbers(self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]) -> tuple[Any, Any]:
        """The arguments node `k` (an op on split inputs with a number, `NodeTable.numbered`)
        runs with: this call's, with the captured number at each position `_shares` gives
        (``((out - y) ** 2 / x.size(0)).sum()``); tells the table whether the node has any
        (`NodeTable.checked`)."""
        own, spec = _flatten(args, kw)
        global_, global_spec = flatten_call(*captured)
        # (a call of another structure than the captured one, a keyword given positionally:
        # nothing to compare it with, and the node takes its short path)
        at = self._shares(k, own, global_, int | float) if spec == global_spec else []
        self.table.checked(k, bool(self.table.shares.get(k)))
        return _with(own, spec, global_, at) if at else (args, kw)

    def factory_numbers(
        self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]
    ) -> tuple[Any, Any]:
        """Factory node `k`'s arguments with the captured number at each position `_shares`
        gives (``torch.tensor(float(x.size(0)))``, ``torch.full(shape, float(b))``'s fill)."""
        if self.table.shares.get(k) == ():  # (none noted in the plan's first call: as called)
            return args, kw
        own, spec = _flatten(args, kw)
        global_, global_spec = flatten_call(*captured)
        at = self._shares(k, own, global_, int | float) if spec == global_spec else []
        return _with(own, spec, global_, at) if at else (args, kw)

    def _shares(self, k: int, own: list[Any], global_: list[Any], kind: Any) -> list[int]:
        """The positions of node `k`'s arguments `own` to give the captured number: those whose
        number of `kind` (or slice, for ints) differed from the captured one the first time the
        plan ran the node (in the call it was captured from: `NodeTable.shares`), when this call
        has that same number there (one that changes from call to call is data: a loss
        weight)."""

        def at() -> list[int]:
            return [
                i
                for i, (x, g) in enumerate(zip(own, global_, strict=True))
                if (isinstance(x, kind) and _number(x) and _number(g))
                or (kind is not float and isinstance(x, slice) and isinstance(g, slice))
            ]

        known = _first_differences(self.table.shares, k, own, global_, at)
        return [i for i, first in known if own[i] == first]

    def factory_sizes(self, args: Any, kw: Any, captured: tuple[Any, Any]) -> tuple[Any, Any]:
        """A factory's arguments (``torch.arange(b)``) with each int that is this call's share
        of the captured global one (times a split count of the plan's device matrix, as a
        size read from this rank's block is) replaced by the global one; other ints (a step
        counter, an offset) stay this call's."""
        own, spec = _flatten(args, kw)
        global_, global_spec = flatten_call(*captured)
        if spec != global_spec:
            return args, kw
        counts = self.split_counts
        changed = False
        for i, (x, g) in enumerate(zip(own, global_, strict=True)):
            share = isinstance(x, int) and isinstance(g, int) and _size(x) and _size(g)
            if share and 0 < x != g and g % x == 0 and g // x in counts:
                own[i], changed = g, True
        if not changed:
            return args, kw
        return unflatten_call(own, spec)

    @property
    def split_counts(self) -> set[int]:
        """The numbers of blocks a dim split over some axes of the plan's matrix has."""
        sizes = [s for s in self.plan.matrix.shape if s > 1]
        counts = {1}
        for s in sizes:
            counts |= {c * s for c in counts}
        return counts - {1}
