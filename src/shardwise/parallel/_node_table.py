"""What the plan executor does at each node of one `ParallelPlan`, worked out once per plan.

- `call_info`: how a torch-level call is treated (`planner.record_kind`) and its qualified name,
  cached per function (torch's `resolve_name` costs microseconds a call).
- `NodeTable`: per plan, read by `_executor.PlanExecutor` on every call: the edges into each
  node and those of returned values, per node whether all its inputs are whole (it then runs
  with the captured sizes: `NodeTable.global_args`), a view's local size argument (a split's
  local part sizes and dim, when the split dim is split: ``sw.strided``), which parameters it
  reads and whether it may return one of them itself (`_param_reads`), and its short path
  (`NodeTable.fast`): a node with no edge in or out, no gradient average (`NodePlan.backward`),
  not a backward root (`NodeTable.roots`, noted for `_seeds`), neither the first nor the last,
  is `PLAIN` (nothing to do but the op on this rank's blocks), `SIZED` (a view given the
  plan's local shape, a split its local sizes) or `DROPOUT` (``F.dropout``, and
  ``F.scaled_dot_product_attention``, whose dropout, whenever a call asks for it, runs as its
  math form with this rank's block of one global mask); under data parallel nearly every node
  is one of these, and the executor runs them after checking only the op (and the
  parameters it reads) against the plan's and counting the cursor. `NodeTable.local` and the
  spans of `_spans` let whole modules of such nodes run without even that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.parallel._edges import copied_moves
from shardwise.parallel._leaving import buffer_edges, leave_edges
from shardwise.parallel._param_reads import node_reads, passing
from shardwise.parallel._sizes import flatten_call, unflatten_call
from shardwise.planner import EdgePlan, NodePlan, ParallelPlan
from shardwise.planner._batch_norm import SPLIT_BATCH_NORM
from shardwise.planner._call_kinds import call_name
from shardwise.planner._capture import record_kind
from shardwise.planner._draws import DROPOUT as DROPOUT_OP
from shardwise.planner._draws import GLOBAL_DRAWS, MAY_DRAW, SDPA
from shardwise.planner._graph import TensorSlot
from shardwise.planner._in_place import in_place
from shardwise.planner._local_factories import FILLS
from shardwise.planner._losses import WEIGHTED_MEAN
from shardwise.planner._strided_reads import strided_read

T = torch.Tensor
_SIZED = {
    "torch.Tensor.view",
    "torch.Tensor.reshape",
    "torch.reshape",
    "torch.Tensor.expand",
    "torch.broadcast_to",
}
_SPLITS = {"torch.Tensor.split", "torch.split", "torch.Tensor.split_with_sizes"}
# views sized by another tensor: run as the view of the plan's local shape (`NodeTable.as_sized`)
_AS: dict[str, Callable[..., Any]] = {
    "torch.Tensor.expand_as": torch.Tensor.expand,
    "torch.Tensor.view_as": torch.Tensor.view,
    "torch.Tensor.reshape_as": torch.Tensor.reshape,
}
# ops whose size arguments name the output's shape (`resized_call`: this rank's block of it)
_RESIZED = {
    "torch.Tensor.unflatten",
    "torch.unflatten",
    "torch.Tensor.new_zeros",
    "torch.Tensor.new_ones",
    "torch.Tensor.new_empty",
    "torch.Tensor.new_full",
}
# factories whose size arguments name their (whole) output's shape (`factory_call`)
_FACTORIES = FILLS
# factories whose int arguments are sizes or bounds (not data, as ``torch.tensor(k)``'s):
# one that is this rank's share of the captured int takes the global one (`factory_sizes`)
SIZED_FACTORIES = {
    *("torch.arange", "torch.linspace", "torch.logspace", "torch.eye", "torch.randperm"),
    *("torch.rand", "torch.randn", "torch.randint", "torch.tril_indices", "torch.triu_indices"),
}

# how the executor runs each node (`NodeTable.fast`)
SLOW = 0  # the full path: edges, captured sizes, the first or last node, returned values
PLAIN = 1  # the op on the blocks as they are
SIZED = 2  # a view: the plan's local shape as the size argument (a split: sizes and dim)
DROPOUT = 3  # this rank's block of one global mask (F.dropout, or SDPA's attention weights)

CALLS: dict[Any, tuple[str, str]] = {}  # `call_info` by function (the executor reads it inline)


def call_info(func: Callable[..., Any]) -> tuple[str, str]:
    """A torch-level call's kind (`record_kind`: ``"op"``, ``"skip"``, ``"backward"`` ...) and
    its qualified name, as the capture records it (cached)."""
    try:
        return CALLS[func]
    except (KeyError, TypeError):
        pass
    info = (record_kind(func), call_name(func))
    with contextlib.suppress(TypeError):  # (an unhashable callable)
        CALLS[func] = info
    return info


def op_name(func: Callable[..., Any]) -> str:
    """A torch function's qualified name, as the capture records it (cached)."""
    return call_info(func)[1]


class NodeTable:
    """The per-node facts of `plan` the executor reads (see the module docstring).

    Args:
        plan: the plan.
        templates: each node's captured arguments (`planner.Node.args` / ``kwargs``), or None.
        dataset: the call's dataset strategy (how returned values leave: `_leaving`).
    """

    def __init__(
        self,
        plan: ParallelPlan,
        templates: list[tuple[Any, Any]] | None,
        dataset: object = "data_parallel",
    ) -> None:
        self.templates = templates
        self.dataset = dataset
        self.leaving = leave_edges(plan, dataset)  # (per node: outputs moved when returned)
        self.buffer_moves = buffer_edges(plan)  # (per node: outputs a buffer is set to)
        for node in self.buffer_moves:  # (their outputs noted too: `Leaving.note_placed`)
            self.leaving[node] = self.leaving[node] or {}
        nodes = plan.nodes
        self.ops = [n.op for n in nodes]
        self.names = [n.name for n in nodes]  # (``module.path/op``)
        self.edges: dict[tuple[int, int], EdgePlan] = {
            (e.consumer, e.slot): e for e in plan.edges if e.consumer >= 0 and not e.written_back
        }
        self.written_back: dict[int, list[EdgePlan]] = {}  # (per node: blocks it changed)
        for e in plan.edges:
            if e.written_back:
                self.written_back.setdefault(e.consumer, []).append(e)
        self.returned: dict[str, list[EdgePlan]] = {}
        for e in plan.edges:
            if e.consumer == -1:
                self.returned.setdefault(e.value, []).append(e)
        self.returning = {int(v[1:].split(".")[0]) for v in self.returned if v.startswith("%")}
        self.averaging = {n.index for n in nodes if n.backward}  # (`NodePlan.backward`)
        self.weighted = {n.index for n in nodes if n.local == WEIGHTED_MEAN}  # (mean losses)
        self.split_norms = {n.index for n in nodes if n.local == SPLIT_BATCH_NORM}
        self.global_draws = {  # (`_global_draws.GlobalDraws`; may draw on split inputs: watched)
            n.index
            for n in nodes
            if n.local == GLOBAL_DRAWS
            or (n.op in MAY_DRAW and any(p.layout.used_axes() for p in n.inputs))
        }
        self.resized = {  # (size arguments: this rank's block, `resized_call`)
            n.index: n.local_shapes[0]
            for n in nodes
            if n.op in _RESIZED
            and (n.local_shapes[0] != n.shapes[0] or any(p.layout.used_axes() for p in n.inputs))
        }
        # (whole inputs: the captured sizes where user code read a split tensor's local shape)
        self.captured = [all(not p.layout.used_axes() for p in n.inputs) for n in nodes]
        self.sized: list[tuple[Any, ...] | None] = [_sized(n) for n in nodes]
        # (``w.expand_as(h)``: ``w.expand`` to the plan's local shape, not to ``h``'s block)
        self.as_sized: dict[int, Callable[..., Any]] = {
            n.index: _AS[n.op] for n in nodes if n.op in _AS
        }
        self.has_param = [any(v.startswith("param:") for v in n.values) for n in nodes]
        # (per node reading a parameter: which, in which input; a call on others is no call
        # of it: `_param_reads`)
        self.reads = {n.index: node_reads(n) for n in nodes if self.has_param[n.index]}
        self.passing = passing(plan)  # (may return a parameter input itself: its view)
        # (``as_strided`` and kin: moved inputs made contiguous, one device's layout)
        self.strided_reads = {n.index for n in nodes if strided_read(n.op)}
        # (`_seeds`) the nodes whose outputs a train step's backward starts from: output index
        # -> the seed's scale; they take the full path, which notes those outputs
        self.roots: dict[int, dict[int, int]] = {}
        for root in plan.roots:
            if root.value.startswith("%"):
                k, _, i = root.value[1:].partition(".")
                self.roots.setdefault(int(k), {})[int(i or 0)] = root.placed.spread()
        moved = {k for k, _ in self.edges} | set(self.written_back)
        # an in-place op whose input 0 is moved changes a copy: the nodes reading the result of
        # an in-place op (of that copy, or of one changed after it) get it even when the
        # network reads the tensor it changed (`_node_run.current`)
        changes = {
            k
            for k, n in enumerate(nodes)
            if in_place(n.op) or (templates is not None and _inplace_kw(templates[k]))
        }
        self.in_place_moved = {k for k in changes if (k, 0) in self.edges}
        self.copied = copied_moves(self.edges, changes)  # (given a fresh copy)
        outs = {f"%{k}" for k in changes} if self.in_place_moved else set()
        self.reads_in_place = {
            n.index for n in nodes if any(v.split(".")[0] in outs for v in n.values)
        }
        # (``out=`` calls: the result stored in the out tensors on the full path, `_node_run`)
        self.outs = {k for k, t in enumerate(templates or ()) if "out" in t[1]}
        self.fast = [
            self._kind(k, n.op)
            if n.values
            and not n.comms
            and k not in moved
            and k not in self.returning
            and k not in self.averaging
            and k not in self.weighted
            and k not in self.split_norms
            and k not in self.global_draws
            and k not in self.resized
            and k not in self.reads_in_place
            and k not in self.roots
            and k not in self.outs
            else SLOW
            for k, n in enumerate(nodes)
        ]
        # (when parameters enter ops through a hook: only nodes that read none)
        self.fast_no_param = [
            SLOW if h else f for f, h in zip(self.fast, self.has_param, strict=True)
        ]
        # ops on split inputs given a Python number (``h / x.size(0)``, ``new_full``'s fill):
        # the full path, which checks it against the captured one (`_sizes.Sizes.numbers`),
        # until `checked` (a ``new_*``'s sizes it gives are then its local ones: `resized`)
        self.numbered = {
            k
            for k, n in enumerate(nodes)
            if templates is not None
            and not self.captured[k]
            and self.fast[k] in (PLAIN, SLOW)
            and n.op not in _SPLITS
            and not n.op.startswith("shardwise.")
            and _has_number(templates[k])
        }
        self.unchecked = {k: (self.fast[k], self.fast_no_param[k]) for k in self.numbered}
        # (`_sizes`) per node run: the positions of its arguments whose number differed from
        # the captured one the first time it ran, with that number
        self.shares: dict[int, tuple[tuple[int, Any], ...]] = {}
        # (`_sizes`) per node on whole inputs: its sizes that came from a local shape, likewise
        self.local_sizes: dict[int, tuple[tuple[int, Any], ...]] = {}
        for j in self.unchecked:
            self.fast[j] = self.fast_no_param[j] = SLOW
        self.flat_templates: dict[int, tuple[list[Any], Any]] = {}
        self.inputs = [len(n.inputs) for n in nodes]
        # (`_spans`) whether each node runs as the network calls it: plain ops yes, views and
        # dropouts once seen (None until then); the candidate modules, their observed spans
        self.local = [  # (a skipped module would not note outputs held for leaving, nor keep a
            # returned parameter apart: `_param_reads.passing`)
            False if leave is not None or k in self.passing else _local(f, op)
            for k, (f, op, leave) in enumerate(zip(self.fast, self.ops, self.leaving, strict=True))
        ]
        self.candidates: set[str] | None = None
        self.guards: dict[str, list[Any]] = {}  # per candidate: its nn.Dropouts (p must stay 0)
        self.spans: dict[str, tuple[int, int] | None] = {}
        self.first_in_network: bool | None = None  # the plan's first op inside the network

    def checked(self, k: int, differed: bool) -> None:
        """Node `k`'s numbers were checked (`numbered`): a node whose numbers were the captured
        ones takes its short path from now on; one with another keeps the full path."""
        kinds = self.unchecked.pop(k, None)
        if kinds is None:
            return
        if differed:
            self.local[k] = False
            return
        self.numbered.discard(k)
        self.fast[k], self.fast_no_param[k] = kinds
        if self.local[k] is False and self.leaving[k] is None and k not in self.passing:
            self.local[k] = _local(kinds[0], self.ops[k])

    def _kind(self, k: int, op: str) -> int:
        """The short path of node `k` (called with no edge in or out): `SLOW` for the first
        and last nodes and for whole ones given the captured sizes."""
        if not 0 < k < len(self.ops) - 1 or (self.templates is not None and self.captured[k]):
            return SLOW
        if self.sized[k] is not None:
            return SIZED
        return DROPOUT if op in (DROPOUT_OP, SDPA) else PLAIN

    def global_args(
        self, k: int, tensors: list[T], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Node `k`'s captured call (global sizes) with this call's `tensors` in it."""
        assert self.templates is not None
        if len(tensors) != self.inputs[k]:
            return args, kw
        flat = self.flat_templates.get(k)
        if flat is None:  # (a TensorSlot is a leaf: no container, no registered pytree node)
            targs, tkw = self.templates[k]
            flat = self.flat_templates[k] = flatten_call(tuple(targs), dict(tkw))
        leaves = [tensors[x.slot] if isinstance(x, TensorSlot) else x for x in flat[0]]
        out = unflatten_call(leaves, flat[1])
        return tuple(out[0]), dict(out[1])


def _has_number(template: tuple[Any, Any]) -> bool:
    """Whether a captured call has a Python int or float argument (not a bool), or a slice
    with an int bound (``h[:, : n // 2]``)."""
    return any(
        (isinstance(x, int | float) and not isinstance(x, bool))
        or (isinstance(x, slice) and any(isinstance(b, int) for b in (x.start, x.stop, x.step)))
        for x in pytree.tree_leaves(template, is_leaf=lambda x: isinstance(x, TensorSlot))
    )


def _inplace_kw(template: tuple[Any, Any]) -> bool:
    """Whether a captured call passed ``inplace=True`` (``F.relu(x, inplace=True)``)."""
    kwargs = template[1] if len(template) > 1 else {}
    return isinstance(kwargs, dict) and kwargs.get("inplace") is True


def _local(fast: int, op: str) -> bool | None:
    """Whether a node runs as the network calls it, as far as its short path tells (`_spans`):
    a plain torch op yes (a primitive runs through its module hooks: no), a view or a dropout
    once its first call is seen (None until then), anything else no."""
    if op.startswith("shardwise."):
        return False
    return True if fast == PLAIN else None if fast in (SIZED, DROPOUT) else False


def _sized(n: NodePlan) -> tuple[Any, ...] | None:
    """The size arguments node `n` runs with on a rank's blocks (after its tensor), or None
    when its own are right: a view's local shape; a split's local part sizes and its dim (a
    split dim: each rank's share of every part; a whole one: the captured sizes, which sizes
    the network computes from a split tensor's local shape would not give)."""
    if n.op in _AS:  # (the other tensor's block may be another shape than the output's)
        return (n.local_shapes[0],)
    if n.op in _SIZED:
        return (n.local_shapes[0],) if n.shapes[0] != n.local_shapes[0] else None
    if n.op not in _SPLITS or not n.in_shapes or len(n.shapes) < 2:
        return None
    whole = n.in_shapes[0]
    dims = [d for d in range(len(whole)) if any(s[d] != whole[d] for s in n.shapes)]
    if len(dims) != 1:
        return None
    d = dims[0]
    return ([s[d] for s in n.local_shapes], d)


def resized_call(
    op: str, args: tuple[Any, ...], kw: dict[str, Any], local: tuple[int, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call of `op` (one of `_RESIZED`: ``unflatten``, ``new_zeros`` /
    ``new_ones`` / ``new_empty`` / ``new_full``) with its sizes replaced by this rank's: the
    plan's local output shape `local`. (The network may give the global sizes, constants of
    its configuration, or the local ones, read from its blocks: either way the same call.)

    Example:
        >>> resized_call("torch.Tensor.unflatten", (x, 0, (8, 16)), {}, (4, 16, 32))
        ((x, 0, (4, 16)), {})
    """
    x, rest = args[0], dict(kw)
    if op.endswith("unflatten"):
        bound = dict(zip(("input", "dim", "sizes"), args, strict=False)) | rest
        d = int(bound["dim"]) % x.dim()
        return (x, d, tuple(local[d : d + len(bound["sizes"])])), {}
    rest.pop("size", None)
    if op.endswith("new_full"):
        fill = args[2] if len(args) > 2 else rest.pop("fill_value")
        return (x, local, fill), rest
    return (x, local), rest


def factory_call(
    op: str, args: tuple[Any, ...], kw: dict[str, Any], shape: tuple[int, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a factory call with its sizes the plan's global output `shape` (the
    factory makes its output whole, as planned, however the network computed its sizes; one of
    `_FACTORIES`), or the call's own for any other op.

    Example:
        >>> factory_call("torch.zeros", (4, 16), {"dtype": torch.float16}, (8, 16))
        (((8, 16),), {'dtype': torch.float16})
    """
    if op not in _FACTORIES:
        return args, kw
    rest = dict(kw)
    rest.pop("size", None)
    if op == "torch.full":
        fill = args[1] if len(args) > 1 else rest.pop("fill_value")
        return (shape, fill), rest
    return (shape,), rest
