"""Which ops change a tensor in place, and the in-place changes a plan cannot carry out.

- `in_place`: a torch-level op that changes its first input (``torch.Tensor.clamp_``,
  ``torch.Tensor.__iadd__``), by its name.
- `writes_input`: a captured node that may write into one of its inputs (also item
  assignment, ``inplace=True``, any ``__i...__`` method; a call with ``out=`` is captured as
  the node of its result, which reads no out tensor: `_out_calls`): the backward analyses
  (`_backward`, `_seeded`) treat such a node as aliasing its input.
- `call_writes`: the same for a call being captured (its name, keywords and aten program): a
  call returning its input object without writing it (``h.to(torch.float32)`` on a float32
  ``h``, ``h.float()``, ``h.type_as(h)``) returns the input's value as a value of its own
  (`apart`: a view of it, so that the input object keeps its value for its later reads).
- `check_change`: why the plan executor cannot hand an in-place change to later reads (the
  planner asks for each torch node whose input 0 it places, and raises it);
  `written_through`: the views an in-place op changes and those ops, which a planner runs on
  their input as placed; `shared_input`: the input whose storage a node's output shares (a
  view, from the alias annotations of its aten ops' schemas).
- `written_inputs`: the inputs a node's aten program changes in place (its schema's ``(a!)``
  arguments; a training batch norm's running statistics, which ``native_batch_norm``
  changes without saying so); `write_back_edges`: for a whole buffer such a node gets as a
  block (the buffer itself, or the output of an in-place op or a view of it:
  ``self.ema.mul_(0.9).add_(x)``), the edge that gathers the changed block back into it after
  the op; `aliased`: the value an in-place op's output or a view is (a buffer:
  ``self.ema.mul_(0.9)``), `activation`: whether a value is none of a buffer or parameter;
  `buffer_writes`: the inputs a torch op changes in place that are a buffer or an alias of one
  (the automatic planners keep them whole, as the buffer, so a chain of in-place ops runs on
  the buffer itself: ``self.ema.mul_(0.9).add_(u).clamp_(min=-1)``; `whole_inputs` gives
  them so, `buffer_write_error` says why an op has no strategy that does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise._torch.dispatch import returned_aliases
from shardwise.planner._graph import AtenArg, AtenCall, Graph, Node, Ref
from shardwise.planner._placement import _itemsize
from shardwise.planner._plan import EdgePlan, Placed
from shardwise.redistribution import plan_redistribution

_IN_PLACE_DUNDERS = {
    f"__i{name}__"
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or")
} | {"__ixor__", "__ilshift__", "__irshift__"}


def in_place(op: str) -> bool:
    """Whether torch-level `op` changes its first input in place (``torch.Tensor.clamp_``,
    ``torch.Tensor.__iadd__``).

    Example:
        >>> in_place("torch.Tensor.clamp_"), in_place("torch.Tensor.__iadd__")
        (True, True)
    """
    name = op.rsplit(".", 1)[-1]
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


def writes_input(node: Node) -> bool:
    """Whether `node` may write into one of its inputs (its output is then that input)."""
    name = node.op.rsplit(".", 1)[-1]
    if name.startswith("__"):
        return name.startswith("__i") or name == "__setitem__"
    return name.endswith("_") or bool(node.kwargs.get("inplace"))


def call_writes(op: str, kwargs: Mapping[str, object], aten: Sequence[AtenCall]) -> bool:
    """Whether torch-level call `op` (its keyword arguments `kwargs`, its aten program `aten`)
    writes into one of its inputs: by its name (`in_place`), ``inplace=True``, or an aten op
    of its program changing an input (an ``(a!)`` argument: ``F.relu(x, True)``)."""
    if in_place(op) or kwargs.get("inplace") is True:
        return True
    return bool(_written(aten))


def apart(out: Any, ins: Sequence[torch.Tensor]) -> Any:
    """`out` with each tensor that is one of the call's inputs `ins` replaced by a view of it.

    A call returning its input object unchanged (``h.to(torch.float32)`` on a float32 ``h``,
    ``h.float()``, ``h.type_as(h)``, ``torch.atleast_2d``, dropout in eval) is a node whose
    output is a value of its own, which the plan may place apart from its input (the input
    moved for that node); the input object keeps its value for its later reads (T5's
    ``h * torch.rsqrt(h.to(torch.float32).pow(2).mean(-1, keepdim=True))``). Capture calls
    it inside its torch-function mode's handler, where the view is no node."""

    def part(t: Any) -> Any:
        is_input = isinstance(t, torch.Tensor) and any(t is x for x in ins)
        return t.view_as(t) if is_input else t

    return part(out) if isinstance(out, torch.Tensor) else pytree.tree_map(part, out)


def check_change(
    graph: Graph,
    state: Mapping[Ref, Placed],
    edges: Sequence[EdgePlan],
    node: Node,
    dst: Placed | None,
) -> str | None:
    """Why `node` changes its input 0 in place where the executor cannot hand the change to
    later reads (a `PlanError`'s message), or None (`_node_run.current` covers an in-place op
    on a moved input itself): item assignment on a moved value (it returns nothing), or a
    change through a view (`shared_input`: ``o.detach()``, ``o.t()``, a slice) when the view
    or a value it shows was moved for it (later reads go to the base, and a moved view holds
    a copy, or only this rank's part of it). `dst`: input 0's move (None: none); `state`:
    each value's placement; `edges`: the moves planned so far."""
    ref = node.inputs[0]
    setitem = node.op.endswith("__setitem__")
    changes = setitem or in_place(node.op) or node.kwargs.get("inplace") is True
    if not changes or ref.kind != "node":
        return None
    chain = _chain(graph, ref)
    view = any(not writes_input(graph.nodes[k]) for k, _ in chain)
    base_moved = view and any((e.consumer, e.slot) in chain for e in edges)
    if not ((setitem or view) and (dst is not None or base_moved)):
        return None
    what = "sets items of" if setitem else "changes a view of"
    move = f"{state[ref]} -> {dst}" if dst is not None else "the view's base"
    return (
        f"{node.op} ({node.name} at {node.source}) {what} a value in place, but the plan "
        f"moves it first ({move}), so the change would land in a moved copy, not in the "
        f"tensor the network reads next; write it out of place (torch.where, "
        f"x.masked_fill(...), torch.cat)"
    )


def written_through(graph: Graph) -> frozenset[int]:
    """The nodes that must run on their input as it is placed: each view that an in-place
    op changes (directly or through further views and in-place ops: ``o.detach().mul_(0.5)``,
    ``o.t()[0].zero_()``) and those in-place ops. A moved view would be a copy, and the
    change would miss the value it shows (`check_change`); the automatic planners' choices
    are overridden for them where a rule runs them so (`_planner.Planner.torch_node`)."""
    out: set[int] = set()
    for node in graph.nodes:
        writes = node.op.endswith("__setitem__") or in_place(node.op)
        if not node.inputs or not (writes or node.kwargs.get("inplace") is True):
            continue
        chain = _chain(graph, node.inputs[0])
        if any(not writes_input(graph.nodes[k]) for k, _ in chain):
            out |= {node.index, *(k for k, _ in chain)}
    return frozenset(out)


def shared_input(node: Node, out: int = 0) -> int | None:
    """The input of `node` whose storage its output `out` shares (a view: ``detach``, ``t``,
    a slice, ``split``'s outputs, ``expand``, ``as_strided``, ``unfold``, a ``reshape`` that
    needs no copy; an in-place op's output; an input returned as it is: ``h.float()`` on a
    float32 ``h``), or None: read from its aten program, the alias annotations of each aten
    op's schema (`returned_aliases`); an in-place op by its name (`in_place`) shares input 0.

    Example:
        >>> shared_input(node)  # doctest: +SKIP  (%1: o.detach())
        0
    """
    arg = node.out_map[out] if out < len(node.out_map) else None
    while isinstance(arg, AtenArg) and arg.kind == "tmp":
        arg = _shown(node.aten, arg.index)
    if isinstance(arg, AtenArg):
        return arg.index
    return 0 if out == 0 and node.inputs and in_place(node.op) else None


def _shown(aten: Sequence[AtenCall], tmp: int) -> AtenArg | None:
    """The argument whose storage the aten program's `tmp`-th tensor shares, or None."""
    for call in aten:
        at = [i for i, o in enumerate(call.outputs) if o.kind == "tmp" and o.index == tmp]
        if not at:
            continue
        returns = returned_aliases(call.op)
        if len(returns) == len(call.outputs):
            shared = returns[at[0]]
        else:  # (a list return, or several returns and lists: any of them)
            shared = tuple(i for r in returns for i in r)
        for i in shared:
            if i < len(call.args) and isinstance(call.args[i], AtenArg):
                found: AtenArg = call.args[i]
                return found
        return None
    return None


def _chain(graph: Graph, ref: Ref) -> set[tuple[int, int]]:
    """The (node, input slot) pairs through which `ref` shows another value's storage: its
    producer's, when that shares an input's storage (`shared_input`), then that input's."""
    out: set[tuple[int, int]] = set()
    while ref.kind == "node":
        node = graph.nodes[int(ref.key)]
        slot = shared_input(node, ref.index)
        if slot is None or slot >= len(node.inputs):
            break
        out.add((node.index, slot))
        ref = node.inputs[slot]
    return out


_RUNNING_STATS = {"aten.native_batch_norm.default": (3, 4)}
"""Ops that change arguments in place without an ``(a!)`` in their schema: positions."""


def written_inputs(node: Node) -> set[int]:
    """The indices of `node`'s inputs that its aten program changes in place.

    Example:
        >>> written_inputs(node)  # doctest: +SKIP  (F.batch_norm(x, m, v, w, b, training=True))
        {1, 2}
    """
    return _written(node.aten)


def _written(aten: Sequence[AtenCall]) -> set[int]:
    """The indices of the inputs that aten program `aten` changes in place."""
    out: set[int] = set()
    for call in aten:
        schema = call.op._schema.arguments
        silent = _RUNNING_STATS.get(str(call.op), ())
        training = len(call.args) > 5 and call.args[5] is True
        for at, value in enumerate(call.args):
            if not isinstance(value, AtenArg) or value.kind != "in" or at >= len(schema):
                continue
            alias = schema[at].alias_info
            if (alias is not None and alias.is_write) or (training and at in silent):
                out.add(value.index)
    return out


def write_back_edges(
    graph: Graph, state: Mapping[Ref, Placed], node: Node, ins: Sequence[Placed]
) -> list[EdgePlan]:
    """For each whole buffer `node` gets as a block (its inputs placed `ins`; `state`: each
    value's placement) and changes in place (a training batch norm's running statistics of
    split features; the buffer, or an in-place op's output or a view of it, `aliased`), an
    `EdgePlan` (``written_back``) that gathers the changed block back into the whole value
    after the op."""
    out = []
    for i in sorted(written_inputs(node)):
        ref, block = node.inputs[i], ins[i]
        whole = state[ref]
        if aliased(graph, ref).kind != "buffer" or whole == block:
            continue
        info = graph.info(ref)
        size = _itemsize(info.dtype)
        steps = plan_redistribution(block.layout, whole.layout, info.shape, size).steps
        back = EdgePlan(node.index, i, str(ref), info.shape, block, whole, steps)
        out.append(dataclasses.replace(back, dtype=info.dtype, written_back=True))
    return out


def aliased(graph: Graph, ref: Ref) -> Ref:
    """The value whose storage `ref` is: through the outputs of in-place ops and views
    (`shared_input`) to the value they change or show (``self.ema.mul_(0.9).add_(x)``:
    ``add_`` changes the buffer ``ema``; ``self.ema[:4].add_(x)``, ``self.ema.detach()``
    too).

    Example:
        >>> aliased(graph, Ref("node", 1))  # doctest: +SKIP  (%1: self.ema.mul_(0.9))
        Ref(kind='buffer', key='ema', index=0)
    """
    while ref.kind == "node":
        node = graph.nodes[int(ref.key)]
        slot = shared_input(node, ref.index)
        if slot is None or slot >= len(node.inputs):
            break
        ref = node.inputs[slot]
    return ref


def activation(graph: Graph, ref: Ref) -> bool:
    """Whether `ref` is an activation: a call input or a node's output, not a buffer or a
    parameter nor an in-place op's output or a view of one (`aliased`)."""
    return aliased(graph, ref).kind in ("input", "node")


def buffer_writes(graph: Graph, node: Node) -> tuple[int, ...]:
    """The input slots a torch-level `node` changes in place (an in-place method, item
    assignment, ``inplace=True``: its input 0) that are a buffer or an alias of one
    (`aliased`: the output of an in-place op on it or a view of it). A planner keeps them
    whole, as the buffer is on every rank: the op then changes the buffer itself, and so does
    any later in-place op on its output (a block would be a copy, which a third op in a chain
    ``self.ema.mul_(0.9).add_(u).clamp_(min=-1)`` changes alone).

    Example:
        >>> buffer_writes(graph, node)  # doctest: +SKIP  (%2: self.ema.mul_(0.9).add_(u))
        (0,)
    """
    if node.is_primitive or not node.inputs:
        return ()
    writes = in_place(node.op) or node.op.endswith("__setitem__")
    if not (writes or node.kwargs.get("inplace") is True):
        return ()
    return (0,) if aliased(graph, node.inputs[0]).kind == "buffer" else ()


def whole_inputs(
    combos: Sequence[tuple[Any, ...]], slots: tuple[int, ...], whole: Any
) -> list[tuple[Any, ...]]:
    """Input placement combinations `combos` with the inputs of `slots` (`buffer_writes`)
    placed `whole`, as the buffer is on every rank (duplicates dropped, order kept)."""
    if not slots:
        return list(combos)
    given = (tuple(whole if i in slots else p for i, p in enumerate(c)) for c in combos)
    return list(dict.fromkeys(given))


def buffer_write_error(node: Node, slots: tuple[int, ...], matrix: object) -> str:
    """Why `node`, which changes a buffer in place (its inputs `slots`, `buffer_writes`), has
    no strategy: none keeps the buffer whole on `matrix` (a `PlanError`'s message)."""
    return (
        f"{node.name} ({node.op} at {node.source}) changes a buffer in place, which stays "
        f"whole on every rank, but no strategy of it on the device matrix {matrix} keeps "
        f"input {slots[0]} whole; write the update out of place (self.buf = ...) or annotate "
        f"the op with shard()"
    )
