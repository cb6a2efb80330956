"""Run one node of the plan once the executor has matched the call to it (`NodeRun`, mixed
into `_executor.PlanExecutor`, which dispatches the calls and moves the cursor):

- `NodeRun._short`: the op of a node on its short path that needs more than the op itself
  (`NodeTable.fast`): a `SIZED` node (a view given the plan's local sizes; the first time,
  `_spans.SpanRunner.check_sized` also notes whether the network's own sizes give the same
  shapes), a `DROPOUT` one (this rank's block of one global mask: `_local.drop`).
- `NodeRun._factory`: a call without tensor inputs: a factory node (``torch.arange``: the
  node's global sizes, `_node_table.factory_call`, and the captured numbers,
  `_sizes.Sizes.factory_numbers` / ``factory_sizes``), or Python state that is no node.
- `NodeRun._run`, the full path: the node's inputs moved as the plan's edges say
  (`NodeRun._moved_inputs`), the op on the local blocks (`_local.compute`; whole inputs with
  the captured sizes, `_sizes.Sizes`; an ``out=`` call's result stored in its out tensors,
  `planner._out_calls.written`), the edges of its returned values (`NodeRun._returned`: the
  loss's AllReduce, only started) and the gradient averages of its outputs."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shardwise._torch import pytree
from shardwise._torch.checkpointing import checkpointing
from shardwise.parallel._edges import average_outputs, move
from shardwise.parallel._errors import Replan
from shardwise.parallel._global_draws import UnplannedDraw
from shardwise.parallel._local import (
    attention_p,
    compute,
    drop,
    dropout_p,
    float_sum,
    loss_weight,
    summed_loss,
)
from shardwise.parallel._node_table import SIZED, SIZED_FACTORIES, NodeTable, factory_call
from shardwise.parallel._param_reads import call_fits, kept_apart
from shardwise.planner import EdgePlan, ParallelPlan, Placed
from shardwise.planner._call_kinds import resets_each_element
from shardwise.planner._local_factories import fill_shape
from shardwise.planner._out_calls import written

T = torch.Tensor
_NESTED = (list, tuple, dict)


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether no argument is a container (its tensors are the arguments themselves)."""
    return not any(isinstance(a, _NESTED) for a in args) and not any(
        isinstance(v, _NESTED) for v in kwargs.values()
    )


def has_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold a tensor (flat arguments checked without pytree)."""
    if _flat(args, kwargs):
        return any(isinstance(a, T) for a in args) or any(isinstance(v, T) for v in kwargs.values())
    return any(isinstance(t, T) for t in pytree.tree_leaves((args, kwargs)))


ON_PARAMETER = frozenset({"torch.Tensor.requires_grad_"})
"""Ops on a parameter that change the `Parameter` itself, not its values: no node of a plan
(the capture records none; `NodeRun.on_parameter` runs them on the parameter, not on the
weight gathered for compute under optimizer parallel, whose change was undone at the next
gather: the layer trained again). A node of a plan made before (a strategy file) likewise."""


def check_flag_change(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], mid: bool) -> None:
    """Raise ValueError when ``requires_grad_`` changes parameter `name` (``args[0]``) inside
    the wrapped step between the forward's first op and the backward (`mid`): the weights,
    gathered and planned for the whole forward, and the gradient buckets were made with the
    flag it had then (before the forward, the change is checked as between calls)."""
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if not mid or bool(flag) == args[0].requires_grad:
        return
    change = "frozen (requires_grad_(False))" if not flag else "unfrozen (requires_grad_(True))"
    raise ValueError(
        f"AutoParallel: parameter {name!r} is {change} inside the wrapped step after its "
        f"forward started and before its backward; a parallel step computes and reduces "
        f"gradients for the parameters that required one when the forward started; change "
        f"requires_grad at the start of the step (before the forward), after loss.backward(), "
        f"or between calls"
    )


def grad_mode() -> int:
    """The autograd mode a value is moved in (1: grad enabled; 0: ``torch.no_grad()``; 2:
    ``torch.inference_mode()``): a shared edge reuses a move made in the same mode only. A move
    made without grad has no autograd link to its source (a row-parallel bias kept on the first
    rank, a gathered weight), so a training forward after a ``torch.no_grad()`` one moves
    again, and its gradient reaches the source; an inference tensor is never reused outside
    inference mode, nor a move with autograd history inside it."""
    if torch.is_grad_enabled():
        return 1
    return 2 if torch.is_inference_mode_enabled() else 0


class NodeRun:
    """A matched node's run (see the module docstring); `PlanExecutor` sets the attributes."""

    plan: ParallelPlan
    table: NodeTable
    ops: list[str]
    param_value: Callable[[T], T] | None
    moved: dict[tuple[str, Placed, int], T]  # (value, placement, `grad_mode`) -> moved
    started: list[Callable[[], None]]
    run: object
    defer_count: bool
    backward_seen: bool
    swapped: dict[int, tuple[weakref.ref[T], T]]  # in place on a moved copy: id -> its result
    cursor: int
    leaving: list[dict[int, EdgePlan] | None]  # (`_leaving`) per node: its outputs moved on return
    network: torch.nn.Module | None
    grads: dict[int, weakref.ref[T]]  # (`on_gradient`) id -> a parameter's ``.grad``

    if TYPE_CHECKING:

        @property
        def params(self) -> dict[int, str]: ...

        def sizes(
            self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]
        ) -> tuple[Any, Any]: ...

        def numbers(
            self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]
        ) -> tuple[Any, Any]: ...

        def factory_numbers(
            self, k: int, args: Any, kw: Any, captured: tuple[Any, Any]
        ) -> tuple[Any, Any]: ...

        def factory_sizes(
            self, args: Any, kw: Any, captured: tuple[Any, Any]
        ) -> tuple[Any, Any]: ...

        def check_sized(self, func: Callable[..., Any], k: int, args: Any, kwargs: Any) -> Any: ...

        def _checkpointed(self, k: int) -> None: ...

        def abandon(self, op: str) -> bool: ...

        def note_outside(self, op: str, args: Any, out: Any) -> None: ...

        def note_placed(self, k: int, edges: dict[int, EdgePlan], out: Any) -> None: ...

        def note_fill(
            self, edges: dict[int, EdgePlan], asked: tuple[int, ...] | None, out: Any
        ) -> None: ...

        def _advance(self, op: str, did: str, args: tuple[Any, ...], kwargs: Any) -> None: ...

        def _ended(self) -> None: ...

    def on_parameter(self, op: str, args: tuple[Any, ...]) -> bool:
        """Whether call `op` changes a stored `Parameter` itself (``requires_grad_``: no node
        of the plan, as the capture records none: `planner._recorders._is_param`)."""
        return op in ON_PARAMETER and bool(args) and id(args[0]) in self.params

    def on_gradient(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether call `op`, before the forward's first op, resets or scales a parameter's
        ``.grad`` element by element (``module.zero_grad(set_to_none=False)``,
        ``p.grad.zero_()``, ``p.grad.mul_(0.5)``: `resets_each_element`): no node of the plan,
        as the capture records none (`planner._recorders._is_grad`; at the first call every
        ``.grad`` is None): it runs unexamined, as between calls, on each rank's block."""
        if self.cursor or self.backward_seen or self.network is None:
            return False
        if not resets_each_element(op, args, kwargs):
            return False
        t = args[0] if args and isinstance(args[0], T) else None
        if t is None:
            return False
        ref = self.grads.get(id(t))
        if ref is None or ref() is not t:  # (grads made since the last look: look again)
            params = self.network.parameters()
            self.grads = {id(g): weakref.ref(g) for p in params if (g := p.grad) is not None}
            ref = self.grads.get(id(t))
        return ref is not None and ref() is t

    def same_params(self, k: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
        """Whether a call of node `k`'s op reads the parameters node `k` read (`_param_reads`:
        a head picked by a flag runs the same op on another head's weights)."""
        return call_fits(self.table.reads[k], self.params, args, kwargs)

    def _short(
        self, func: Callable[..., Any], fast: int, k: int, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """A `SIZED` node (its local sizes) or a `DROPOUT` one (its block of the mask)."""
        table = self.table
        if fast == SIZED:
            if table.local[k] is None:
                return self.check_sized(func, k, args, kwargs)
            return table.as_sized.get(k, func)(args[0], *(table.sized[k] or ()))
        kwargs = kwargs or {}
        if table.local[k] is None:
            drops = dropout_p if func is F.dropout else attention_p
            table.local[k] = drops(args, kwargs) == 0
        return drop(func, self.plan.nodes[k], args, kwargs)

    def _factory(
        self, func: Callable[..., Any], op: str, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        """A call without tensor inputs: a node when it makes a tensor (``torch.arange``: whole
        on every rank, as planned), else Python state (``torch.set_grad_enabled``), not one.
        A factory of the plan's next node gets the node's global sizes (`factory_call`; any
        other factory its captured sizes where user code read this rank's share of them:
        `Sizes.factory_sizes`)."""
        k, asked = self.cursor, fill_shape(op, args, kw)  # (the shape the code asked for)
        if self.ops[k] == op:
            if checkpointing():  # (a region's first node may be a factory: `_recompute`)
                self._checkpointed(k)
            templates = self.table.templates
            if templates is not None:  # (``torch.tensor(float(b))``: the global b)
                args, kw = self.factory_numbers(k, args, kw, templates[k])
            args, kw = factory_call(op, args, kw, self.plan.nodes[k].local_shapes[0])
            if templates is not None and op in SIZED_FACTORIES:  # (``arange(b)``: the global b)
                args, kw = self.factory_sizes(args, kw, templates[k])
        out = func(*args, **kw)
        if not isinstance(out, T) and not any(isinstance(t, T) for t in pytree.tree_leaves(out)):
            return out
        if self.ops[k] != op and self.abandon(op):  # (a pass only factories started)
            self.note_outside(op, (args, kw), out)
            return out
        node = self.plan.nodes[self.cursor]
        self._advance(op, "made a tensor with", (), None)
        out = self._returned(node.index, out)
        leaving = self.leaving[node.index]
        if leaving is not None:
            self.note_placed(node.index, leaving, out)
            self.note_fill(leaving, asked, out)
        self._ended()
        return out

    def _moved_inputs(
        self, k: int, tensors: list[Any], kept: dict[int, tuple[T, T] | None] | None = None
    ) -> list[Any]:
        """Node `k`'s tensor inputs, each moved as its edge says (shared edges reused);
        `kept`: for each of its slots, the value and the block given to the op (a copy, which
        the op changes in place and autograd may have saved: `EdgePlan.written_back`)."""
        slot = 0
        reads = k in self.table.reads_in_place
        copied = k in self.table.copied  # (its moved input 0, a view: changed in a copy)
        for i, leaf in enumerate(tensors):
            if not isinstance(leaf, T):
                continue
            if reads:
                leaf = self.current(leaf)
            if (
                self.param_value is not None
                and id(leaf) in self.params
                and self.table.ops[k] not in ON_PARAMETER
            ):
                leaf = self.param_value(leaf)
            edge = self.table.edges.get((k, slot))
            if edge is not None:  # (reused only in the grad mode it was moved in: `grad_mode`)
                key = (edge.value, edge.dst, grad_mode())
                if edge.shared and key in self.moved:
                    leaf = self.moved[key]
                else:  # (or shared with a move before this pass started, or in another mode)
                    leaf = self.moved[key] = move(leaf, edge, run=self.run)
            if edge is not None and k in self.table.strided_reads:
                leaf = leaf.contiguous()  # (one device's layout: `planner._strided_reads`)
            if copied and slot == 0 and edge is not None:
                leaf = leaf.clone()
            if kept is not None and slot in kept:
                leaf = leaf.clone()
                kept[slot] = (tensors[i], leaf)
            tensors[i] = leaf
            slot += 1
        return tensors

    def _run(
        self, func: Callable[..., Any], k: int, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        table = self.table
        given = None  # (``out=`` tensors: the op's result stored in them, `_out_calls`)
        if "out" in kw:
            kw = dict(kw)
            given = kw.pop("out")
        changed = None  # (an in-place op on a moved input: the tensor the network holds)
        if k in table.in_place_moved:
            changed = next((t for t in pytree.tree_leaves((args, kw)) if isinstance(t, T)), None)
        backs = table.written_back.get(k)
        kept: dict[int, tuple[T, T] | None] | None = (
            dict.fromkeys(e.slot for e in backs) if backs else None
        )
        if _flat(args, kw):  # (no pytree: positional tensors first, then keyword ones)
            leaves = self._moved_inputs(k, [*args, *kw.values()], kept)
            args, kw = tuple(leaves[: len(args)]), dict(zip(kw, leaves[len(args) :], strict=True))
        else:
            leaves, spec = pytree.tree_flatten((args, kw))
            args, kw = pytree.tree_unflatten(self._moved_inputs(k, leaves, kept), spec)
        if table.templates is not None and (table.captured[k] or k in table.numbered):
            tensors = [t for t in leaves if isinstance(t, T)]
            captured = table.global_args(k, tensors, args, kw)
            if table.captured[k]:
                args, kw = self.sizes(k, args, kw, captured)
            else:
                args, kw = self.numbers(k, args, kw, captured)
        weight, wide = None, False
        if k in table.weighted and k in table.returning:  # (this rank's sum, its weight)
            weight = loss_weight(self.plan.nodes[k].op, args, kw)
            args, kw, wide = summed_loss(self.plan.nodes[k].op, args, kw)
        try:
            out = compute(func, k, self.plan.nodes[k], table, args, kw)
        except UnplannedDraw as e:  # (planned without its draws: an eval() call)
            if self.backward_seen:
                raise
            raise Replan(str(e), k, self.ops[k]) from None
        if given is not None:
            out = written(given, out)
        if k in table.passing:  # (a parameter it returned itself: a view, as the capture's)
            out = kept_apart(out, self.params)
        if backs and kept is not None:
            self._write_back(backs, kept)
        if wide:  # (a float16 loss: its elements summed in float32)
            total, narrow = float_sum(out)
            out = self._returned(k, total, weight, wait=narrow is not None)
            out = out.to(narrow) if narrow is not None else out
        else:
            out = self._returned(k, out, weight)
        if k in table.averaging:
            average_outputs(out, self.plan.nodes[k], self.plan.matrix)
        if changed is not None and isinstance(out, T):  # (later reads of it get `out`)
            self.swapped[id(changed)] = (weakref.ref(changed), out)
        return out

    def _write_back(self, backs: list[EdgePlan], kept: dict[int, tuple[T, T] | None]) -> None:
        """Gather each block the op changed in place back into its whole buffer
        (`EdgePlan.written_back`: a batch norm's running statistics of split features)."""
        with torch.no_grad():
            for back in backs:
                pair = kept[back.slot]
                assert pair is not None  # (every written-back slot is an input the op got)
                whole, block = pair
                whole.copy_(move(block, back, run=self.run))

    def current(self, t: Any) -> Any:
        """`t`, or what an in-place op of the plan made of it in a moved copy (`swapped`: the
        network reads the tensor it changed in place, ``x.clamp_(min=0); y = f(x)``)."""
        entry = self.swapped.get(id(t)) if self.swapped else None
        return entry[1] if entry is not None and entry[0]() is t else t

    def _returned(self, k: int, out: Any, weight: T | None = None, wait: bool = False) -> Any:
        """Apply the edges of the node's returned outputs (the loss's AllReduce; a mean loss
        run as this rank's sum, divided by the summed targets the ranks counted, this rank's
        `weight`: `planner.WEIGHTED_MEAN`); `wait`: finish the AllReduce before returning (a
        result read at once), not only start it."""
        if k not in self.table.returning:
            return out
        if isinstance(out, T):  # (one tensor: no pytree)
            started = None if wait else self.started
            for e in self.table.returned.get(f"%{k}", []):
                out = move(out, e, started, weight, self.run, self.defer_count)
            return out
        leaves, spec = pytree.tree_flatten(out)
        j = 0
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, T):
                continue
            name = f"%{k}" + (f".{j}" if j else "")
            for e in self.table.returned.get(name, []):
                leaves[i] = move(leaves[i], e, run=self.run)
            j += 1
        return pytree.tree_unflatten(leaves, spec)
