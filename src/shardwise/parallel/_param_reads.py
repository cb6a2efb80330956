"""Which parameters a node of a plan reads, and whether a call of its op reads the same ones.

Two calls of one op on different parameters are different nodes: a head picked from an
``nn.ModuleDict`` by a flag runs the same ``F.linear`` on ``heads.a``'s or ``heads.b``'s
weights, and each head's weights may be stored and moved differently (one annotated, one not).
The plan executor checks each call of a node that reads parameters against the node's
(`fits`), and a call that reads others is a mismatch like another op (planned again before a
backward: `_errors.Replan`, whose `params` `_variants.known_variant` matches against the kept
plans).

- `node_reads(node)`: per tensor input of a node, the parameter's name or None.
- `call_reads(params, args, kwargs)`: the same for a call's tensors (`params`: id -> name).
- `fits(want, got)` (`call_fits`: from the call's arguments): whether a call's reads are the
  node's: every parameter the call passes is the one the node read in that place (a tensor
  that is no parameter where the node read one passes: an alias made outside the plan's view,
  such as a hook's copy).
- `alike(plan, want, got)`: whether the other parameters a call reads are stored and reduced
  as the node's are (after a backward, where no plan can be made: a later pass of a step that
  trains one head after another runs the node on the other head's weights).
- `passing(plan)` / `kept_apart(out, params)`: an op that returns its parameter input itself
  (``w.float()`` on a float32 ``w``, ``w.flatten(1)`` on a 2-D one, ``F.dropout`` in eval: as
  the capture saw it, `NodePlan.returned`) is a node whose output is a value of its own (the
  capture gives it a view of the parameter: `planner._in_place.apart`), so the nodes reading
  it read no parameter; the executor gives those nodes' calls the same view (`kept_apart`, on
  the nodes `passing` names), so that a call reading the op's result is not taken for one
  reading the parameter (spectral norm's ``torch.mv(weight.flatten(1), v)``, Gemma's
  ``1.0 + self.weight.float()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.planner import NodePlan, ParallelPlan
from shardwise.planner._in_place import in_place

T = torch.Tensor
Reads = tuple[str | None, ...]
_NESTED = (list, tuple, dict)
_PARAM = "param:"


def node_reads(node: NodePlan) -> Reads:
    """Per tensor input of `node` (its `values`), the parameter's name, or None.

    Example:
        >>> node_reads(plan.nodes[3])  # doctest: +SKIP
        (None, 'heads.a.weight', 'heads.a.bias')
    """
    return tuple(v[len(_PARAM) :] if v.startswith(_PARAM) else None for v in node.values)


def call_reads(
    params: Mapping[int, str], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Reads:
    """Per tensor of a call (in the order a node's inputs are: positional, then keyword
    arguments, nested ones flattened), the name `params` gives it (id -> name), or None."""
    leaves: Any = (*args, *kwargs.values()) if kwargs else args
    if any(isinstance(a, _NESTED) for a in leaves):
        leaves = pytree.tree_leaves((args, dict(kwargs)))
    return tuple(params.get(id(t)) for t in leaves if isinstance(t, T))


def fits(want: Reads, got: Reads) -> bool:
    """Whether a call reading `got` (`call_reads`) is a call of a node reading `want`
    (`node_reads`): each parameter it passes is the node's in that place."""
    return all(name is None or (i < len(want) and want[i] == name) for i, name in enumerate(got))


def call_fits(
    want: Reads, params: Mapping[int, str], args: tuple[Any, ...], kwargs: Mapping[str, Any] | None
) -> bool:
    """`fits(want, call_reads(params, args, kwargs))`, in plain loops (the executor's short
    path runs it for every node reading a parameter)."""
    i = 0
    for group in (args, kwargs.values()) if kwargs else (args,):
        for a in group:
            if isinstance(a, T):
                name = params.get(id(a))
                if name is not None and (i >= len(want) or want[i] != name):
                    return False
                i += 1
            elif isinstance(a, _NESTED):
                return fits(want, call_reads(params, args, kwargs or {}))
    return True


def alike(plan: ParallelPlan, want: Reads, got: Reads) -> bool:
    """Whether each parameter of `got` that is not `want`'s in its place is stored as that one
    is (layout, shape, dtype), its gradient reduced alike (`ParallelPlan.equal_grads`) and
    frozen alike: the node's moves and collectives are then the same for it (a second pass of a
    step reading another head, after a backward, when it cannot be planned again)."""
    params, equal = plan.params, plan.equal_grads
    for i, name in enumerate(got):
        mine = want[i] if i < len(want) else None
        if name is None or name == mine:
            continue
        if mine is None or name not in params or params[name] != params.get(mine):
            return False
        if equal.get(name) != equal.get(mine) or (name in plan.frozen) != (mine in plan.frozen):
            return False
    return True


def passing(plan: ParallelPlan) -> frozenset[int]:
    """The nodes of `plan` that return one of their parameter inputs itself: the capture saw
    the op return that input object (`NodePlan.returned`: ``w.float()`` on a float32 ``w``,
    ``w.flatten(1)`` on a 2-D one) and it does not change its input in place."""
    return frozenset(
        n.index
        for n in plan.nodes
        if n.returned
        and not in_place(n.op)
        and any(i < len(n.values) and n.values[i].startswith(_PARAM) for i in n.returned)
    )


def _apart(t: Any, params: Mapping[int, str]) -> Any:
    return t.view_as(t) if isinstance(t, T) and id(t) in params else t


def kept_apart(out: Any, params: Mapping[int, str]) -> Any:
    """`out` with each tensor that is a parameter of `params` (id -> name) replaced by a view of
    it, as the capture made it (`passing`): a later call on it reads the op's result."""
    if isinstance(out, T):
        return _apart(out, params)
    return pytree.tree_map(lambda t: _apart(t, params), out)


def shown(reads: Reads) -> str:
    """The parameters of `reads`, for a message (``"heads.b.weight, heads.b.bias"``)."""
    return ", ".join(n for n in reads if n is not None) or "no parameter"
