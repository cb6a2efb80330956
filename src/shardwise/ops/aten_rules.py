"""Sharding rules of torch ops, for the planner: ``decide(aten_op, args, kwargs, mesh)``.

A torch-level op (``F.linear``, ``x.view(...)``) runs as one or more aten ops; the planner asks
this module about each. The answer (`Decision`) says which placements (DTensor's ``Shard(d)``,
``Replicate()``, ``Partial()``, one per mesh dim) every tensor argument must have and which its
outputs get, and where the rule came from (`Decision.source`):

- ``"shardwise"``: an entry of `ATEN_RULES` below: shardwise's own rules, only for what
  torch 2.13's DTensor lacks;
- ``"dtensor"``: DTensor's sharding strategies (about 1,160 aten overloads: matmuls, views,
  pointwise ops, norms, embedding, losses, convolution, pooling, ...), queried through
  `shardwise.ops._dtensor` without a process group;
- ``"factory"``: an op without tensor arguments (``arange``, ``zeros``): outputs replicated;
- ``"replicate"``: no rule anywhere: every tensor argument is made whole and the op runs
  replicated (always correct; it costs AllGathers, and `Decision` says so).

The rules of shardwise's primitives (``sw.ops.MatMul`` ...) are in `shardwise.ops.rules`.

Adding an op: one entry in `ATEN_RULES`, ``"aten.<name>.<overload>": rule``, where ``rule(args,
mesh_ndim)`` receives the op's arguments with each tensor as an `Arg` (placements, shape) and
returns a `Decision` (see `sdpa_cpu_rule`), or None to leave this call to DTensor's rule (see
`strided_split_rule`). An entry here wins over DTensor's rule. (An op whose DTensor rule
misreads a negative dim is one entry in `_dtensor.NEGATIVE_DIMS`.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardwise._torch.dtensor import OutMeta, StridedShard
from shardwise.ops import _flat as flat
from shardwise.ops._dtensor import Spec, has_rule, propagate
from shardwise.ops._odd_partials import LOGICAL_OR_OPS as LOGICAL_OR_OPS
from shardwise.ops._odd_partials import odd_partial_axes as odd_partial_axes
from shardwise.ops._odd_partials import whole_on

Placements = tuple[Placement, ...]
Arg = Spec
"""A tensor argument: ``.placements`` (one per mesh dim), ``.shape``, ``.stride``, ``.dtype``."""


@dataclass(frozen=True)
class Decision:
    """How one aten call runs distributed.

    Attributes:
        inputs: the placements each tensor argument must have (pytree order of the arguments).
        outputs: the placements of each output (None: not a tensor).
        source: ``"shardwise"``, ``"dtensor"``, ``"factory"`` or ``"replicate"``.
    """

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    source: str


AtenRule = Callable[[Sequence[Any], int], Decision | None]


def _rep(n: int) -> Placements:
    return tuple(Replicate() for _ in range(n))


def _is_split(p: Placement) -> bool:
    """Whether `p` splits a dim: ``Shard`` or ``_StridedShard`` (a tuple of axes in an order
    other than the mesh's, e.g. rows over ``("mp", "dp")``; not a subclass of ``Shard``)."""
    return type(p) is Shard or isinstance(p, StridedShard)


def _split_on(p: Placement, dim: int) -> Placement:
    """Split `p` (plain or strided: its split factor kept) on dim `dim`."""
    if isinstance(p, StridedShard):
        return StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


def sdpa_cpu_rule(args: Sequence[Any], ndim: int) -> Decision:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: q, k, v of shape [B, H, S, D].

    Per mesh dim: when q is split (plain or strided) on the batch or head dim, k and v (and a
    mask with that dim, matched to q's dims from the right) are split the same way and the
    output and logsumexp follow; anything else runs replicated.
    """
    q, k, v = args[0], args[1], args[2]
    tensors = [a for a in flat.leaves(list(args)) if isinstance(a, Spec)]
    ins: list[list[Placement]] = [[] for _ in tensors]
    outs: list[Placement] = []
    for m in range(ndim):
        p = q.placements[m]
        keep = _is_split(p) and p.dim in (0, 1)  # type: ignore[attr-defined]
        keep = keep and k.shape[p.dim] == q.shape[p.dim] == v.shape[p.dim]  # type: ignore[union-attr]
        for i, t in enumerate(tensors):  # (a mask broadcasts from the right: [S, S])
            d = p.dim - len(q.shape) + len(t.shape) if keep else -1  # type: ignore[union-attr]
            wide = d >= 0 and t.shape[d] == q.shape[p.dim] > 1  # type: ignore[union-attr]
            ins[i].append(_split_on(p, d) if wide else Replicate())
        outs.append(p if keep else Replicate())
    out = tuple(outs)
    return Decision(tuple(tuple(i) for i in ins), (out, out), "shardwise")


def join_rule(stack: bool) -> AtenRule:
    """``aten.cat`` / ``aten.stack`` of a list of tensors along ``dim``.

    Per mesh dim: when every input is split the same way (plain or strided) on a dim other than
    ``cat``'s joined one (any dim for ``stack``, whose joined dim is new), the output is split
    there too (``stack`` shifts a dim at or after the new one by one; a strided split keeps its
    split factor); anything else is joined whole. (DTensor's strategy for a list argument does
    not report the inputs it needs.)
    """

    def rule(args: Sequence[Any], ndim: int) -> Decision:
        every = [t for t in args[0] if isinstance(t, Spec)]
        # (cat skips empty 1-d tensors, e.g. an empty cache: they take any placement)
        tensors = [t for t in every if stack or t.shape != (0,)] or every
        rank = len(tensors[0].shape) + (1 if stack else 0)
        dim = int(args[1]) if len(args) > 1 and isinstance(args[1], int) else 0
        dim %= rank
        ins: list[Placement] = []
        outs: list[Placement] = []
        for m in range(ndim):
            p = tensors[0].placements[m]
            same = all(t.placements[m] == p for t in tensors) and _is_split(p)
            keep = same and (stack or p.dim != dim)  # type: ignore[attr-defined]
            ins.append(p if keep else Replicate())
            shifted = _split_on(p, p.dim + 1) if keep and stack and p.dim >= dim else p  # type: ignore[attr-defined]
            outs.append(shifted if keep else Replicate())
        empty = tuple(Replicate() for _ in range(ndim))
        need = tuple(tuple(ins) if t in tensors else empty for t in every)
        return Decision(need, (tuple(outs),), "shardwise")

    rule.__name__ = "stack_rule" if stack else "cat_rule"
    return rule


def pointwise_loss_rule(args: Sequence[Any], ndim: int) -> Decision:
    """``aten.mse_loss`` / ``smooth_l1_loss`` / ``huber_loss`` (input, target, reduction, ...).

    Per mesh dim: input and target split the same way (plain or strided) keep their split; the
    loss is then that split (``reduction="none"``) or a partial value (``"mean"``: the mean of
    equal blocks' means, ``"sum"``); anything else runs whole. (DTensor gathers these losses whole.)
    """
    x, target = args[0], args[1]
    reduction = int(args[2]) if len(args) > 2 and isinstance(args[2], int) else 1
    ins: list[Placement] = []
    outs: list[Placement] = []
    for m in range(ndim):
        p = x.placements[m]
        keep = _is_split(p) and target.placements[m] == p and x.shape == target.shape
        ins.append(p if keep else Replicate())
        if not keep:
            outs.append(Replicate())
        elif reduction == 0:
            outs.append(p)
        else:
            outs.append(Partial("avg" if reduction == 1 else "sum"))
    pair = tuple(ins)
    return Decision((pair, pair), (tuple(outs),), "shardwise")


def strided_split_rule(args: Sequence[Any], ndim: int) -> Decision | None:
    """``aten.split.Tensor`` / ``aten.split_with_sizes`` of a dim split strided over one mesh dim.

    ``_StridedShard(d, split_factor=g)`` (a `TensorLayout` strided in g groups, e.g.
    ``sw.strided("mp", 3)`` on a fused q/k/v projection) cuts dim d into g groups and each group
    over the mesh dim. When every part of the split is a whole number j of groups, each part
    keeps the split with no communication: ``Shard(d)`` for one group (q, k and v each split
    over mp, every rank holding its own heads), ``_StridedShard(d, split_factor=j)`` for j; the
    other mesh dims keep their placements (split is linear: partial values stay partial).
    Anything else (parts that cut a group, a dim split by several mesh dims) returns None:
    DTensor's rule, which gathers the split dim.
    """
    x = args[0]
    rank = len(x.shape)
    dim = int(args[2]) % rank if len(args) > 2 and isinstance(args[2], int) else 0
    on_dim = [
        m
        for m, p in enumerate(x.placements)
        if isinstance(p, Shard | StridedShard) and p.dim % rank == dim
    ]
    if len(on_dim) != 1 or not isinstance(x.placements[on_dim[0]], StridedShard):
        return None
    m = on_dim[0]
    n, factor = x.shape[dim], x.placements[m].split_factor
    if n % factor:
        return None
    piece = n // factor
    size = args[1]
    if isinstance(size, int):
        sizes = [size] * (n // size) + ([n % size] if n % size else []) if size > 0 else []
    else:
        sizes = [int(v) for v in size]
    if not sizes or any(v % piece for v in sizes):
        return None
    outs = []
    for v in sizes:
        j = v // piece
        out = list(x.placements)
        out[m] = Shard(dim) if j == 1 else StridedShard(dim, split_factor=j)
        outs.append(tuple(out))
    return Decision((tuple(x.placements),), tuple(outs), "shardwise")


def lift_rule(args: Sequence[Any], ndim: int) -> Decision:
    """``aten.lift_fresh`` / ``lift_fresh_copy``: a constant made a tensor inside the op (the
    value of ``x[..., 0] = 0``): the output is placed as the input. (DTensor has no rule.)"""
    p = tuple(args[0].placements)
    return Decision((p,), (p,), "shardwise")


def fill_rule(args: Sequence[Any], ndim: int) -> Decision:
    """``aten.fill_`` / ``fill`` with a scalar or a 0-d tensor value (``x[..., 0] = 0`` runs
    ``fill_.Tensor`` on a view).

    Per mesh dim: a split keeps its split, a whole value stays whole; a partial value is made
    whole first (every rank writing the value would make the sum N times it; DTensor's rule for
    ``fill_.Scalar`` keeps the partial). The value is replicated. (DTensor has no rule for the
    ``Tensor`` overloads.)
    """
    x = args[0]
    out = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    value = [_rep(ndim)] if len(args) > 1 and isinstance(args[1], Spec) else []
    return Decision((out, *value), (out,), "shardwise")


def masked_fill_tensor_rule(args: Sequence[Any], ndim: int) -> Decision | None:
    """``aten.masked_fill(_).Tensor`` (input, mask, a 0-d tensor value).

    Per mesh dim: a split input (plain or strided) keeps its split and the mask (broadcast from
    the right) is split alike on the same dim where it has it, else whole; a partial input is
    made whole first (the filled entries would sum N times the value); the value is replicated.
    None (DTensor, which has no rule: replicated) for a value with dims, or an input the mask
    broadcasts to more dims or larger sizes. (DTensor has a rule for the ``Scalar`` overloads only.)
    """
    x, mask, value = args[0], args[1], args[2]
    if not isinstance(value, Spec) or value.shape != ():
        return None
    lead = len(x.shape) - len(mask.shape)
    if lead < 0 or any(m not in (1, x.shape[lead + i]) for i, m in enumerate(mask.shape)):
        return None  # (the input broadcast up to the mask: the output has another shape)
    ins: list[Placement] = []
    need_mask: list[Placement] = []
    for p in x.placements:
        keep = _is_split(p)
        ins.append(p if keep else Replicate())
        d = p.dim - lead if keep else -1  # type: ignore[attr-defined]
        wide = keep and d >= 0 and mask.shape[d] == x.shape[p.dim] > 1  # type: ignore[attr-defined]
        need_mask.append(_split_on(p, d) if wide else Replicate())
    out = tuple(ins)
    return Decision((out, tuple(need_mask), _rep(ndim)), (out,), "shardwise")


def mask_put_rule(args: Sequence[Any], ndim: int) -> Decision | None:
    """``aten.index_put(_)`` (input, indices, value, accumulate) whose one index is a boolean
    mask and whose value is 0-d: ``x[x > 1] = 1``, ``x[:, m] += 1``: elementwise.

    Per mesh dim: a split input (plain or strided) keeps its split and the mask, which covers the
    input's dims from its position in the index list on, is split alike where it covers it, else
    whole; a partial input is made whole first (every rank writing or adding the value would
    sum it N times); the value is replicated. None (DTensor's rule) for integer indices, several
    index tensors or a value with dims: which entries a rank writes then depends on the data.
    """
    x, indices, value = args[0], args[1], args[2]
    if not isinstance(value, Spec) or value.shape != () or not isinstance(indices, list | tuple):
        return None
    given = [(k, t) for k, t in enumerate(indices) if t is not None]
    if len(given) != 1 or not isinstance(given[0][1], Spec) or given[0][1].dtype != "bool":
        return None
    start, mask = given[0]
    ins: list[Placement] = []
    need_mask: list[Placement] = []
    for p in x.placements:
        keep = _is_split(p)  # (strided too: rows over ("mp", "dp"))
        ins.append(p if keep else Replicate())
        d = p.dim - start if keep else -1  # type: ignore[attr-defined]
        need_mask.append(_split_on(p, d) if 0 <= d < len(mask.shape) else Replicate())
    out = tuple(ins)
    return Decision((out, tuple(need_mask), _rep(ndim)), (out,), "shardwise")


def strided_ids_embedding_rule(args: Sequence[Any], ndim: int) -> Decision | None:
    """``aten.embedding`` (weight, indices, ...) whose indices are split strided on some mesh
    dim (a tuple of axes over their rows, the later mesh axis outer: ``layout(("mp", "dp"),
    ...)``), which DTensor's rule cannot take.

    Per mesh dim: a whole weight looks up this rank's indices: the output is placed as the
    indices on their dims; a weight split on its embedding dim (dim 1), with whole indices
    there, gives the output's last dim split alike. None (DTensor's rule) without strided
    indices, or for a weight split on its rows (the vocabulary: a masked lookup) or partial.
    """
    weight, ids = args[0], args[1]
    if not any(isinstance(p, StridedShard) for p in ids.placements):
        return None
    need_w: list[Placement] = []
    need_ids: list[Placement] = []
    outs: list[Placement] = []
    for w, i in zip(weight.placements, ids.placements, strict=True):
        if isinstance(i, Partial) or not (isinstance(w, Replicate) or type(w) is Shard):
            return None  # (a partial, or a strided weight: DTensor's rule)
        if isinstance(w, Replicate):
            need_w.append(w)
            need_ids.append(i)
            outs.append(i)
        elif w.dim == 1 and isinstance(i, Replicate):
            need_w.append(w)
            need_ids.append(i)
            outs.append(Shard(len(ids.shape)))
        else:  # (the vocabulary split: DTensor's masked lookup)
            return None
    return Decision((tuple(need_w), tuple(need_ids)), (tuple(outs),), "shardwise")


def restride_rule(args: Sequence[Any], ndim: int) -> Decision | None:
    """``aten.as_strided_`` / ``as_strided`` that changes nothing a value is read by: the same
    sizes, no storage offset, the same stride on every dim of size above 1 (a kernel putting
    back its input's memory format: ``adaptive_avg_pool2d`` of a channels-last tensor restrides
    its ``[N, C, 1, 1]`` mean): the output is placed as the input. Any other (a read of other
    elements): None (no rule: replicated). The planner does not ask this of a user's own
    ``as_strided`` call, whose sizes may be the global ones (`planner._strided_reads`)."""
    x, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else None  # (given: maybe not the input's own offset)
    if list(size) != list(x.shape) or offset is not None:
        return None
    if any(n > 1 and s != t for n, s, t in zip(x.shape, stride, x.stride, strict=True)):
        return None
    p = tuple(x.placements)
    return Decision((p,), (p,), "shardwise")


ATEN_RULES: dict[str, AtenRule] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": sdpa_cpu_rule,
    "aten.cat.default": join_rule(stack=False),
    "aten.stack.default": join_rule(stack=True),
    "aten.mse_loss.default": pointwise_loss_rule,
    "aten.smooth_l1_loss.default": pointwise_loss_rule,
    "aten.huber_loss.default": pointwise_loss_rule,
    "aten.split.Tensor": strided_split_rule,
    "aten.split_with_sizes.default": strided_split_rule,
    "aten.lift_fresh.default": lift_rule,
    "aten.lift_fresh_copy.default": lift_rule,
    "aten.fill_.Scalar": fill_rule,
    "aten.fill_.Tensor": fill_rule,
    "aten.fill.Scalar": fill_rule,
    "aten.fill.Tensor": fill_rule,
    "aten.masked_fill.Tensor": masked_fill_tensor_rule,
    "aten.masked_fill_.Tensor": masked_fill_tensor_rule,
    "aten.index_put.default": mask_put_rule,
    "aten.index_put_.default": mask_put_rule,
    "aten.embedding.default": strided_ids_embedding_rule,
    "aten.as_strided_.default": restride_rule,
    "aten.as_strided.default": restride_rule,
}
"""shardwise's own aten rules (aten overload name -> rule); they win over DTensor's."""


def rule_source(op: Any) -> str:
    """Where `op`'s rule comes from: ``"shardwise"``, ``"dtensor"`` or ``"replicate"`` (an
    op with both answers ``"shardwise"``: its own rule is asked first)."""
    if str(op) in ATEN_RULES:
        return "shardwise"
    return "dtensor" if has_rule(op) else "replicate"


def decide(
    op: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: Any,
    ndim: int,
    out_shapes: Sequence[Sequence[int]] | None = None,
    out_meta: Sequence[OutMeta] | None = None,
) -> Decision:
    """The `Decision` for one aten call whose tensor arguments are `Arg`s (`out_shapes`: its
    tensor outputs' global shapes, when known: DTensor is then asked per mesh dim where it can;
    `out_meta`: their shapes, strides and dtypes, when known: DTensor need not work them out).

    Raises:
        RuntimeError: DTensor refuses the placements (an uneven split); the planner turns it
            into an error naming the op and the fix.
    """
    tensors = [a for a in flat.leaves((list(args), dict(kwargs))) if isinstance(a, Spec)]
    own = ATEN_RULES.get(str(op))
    if own is not None:
        mine = own(list(args) + list(kwargs.values()), ndim)
        if mine is not None:
            return mine
    if has_rule(op):
        try:
            ins, outs = propagate(op, args, kwargs, mesh, out_shapes, out_meta)
            odd = odd_partial_axes(outs, op)
            if odd:  # (a max / min / norm / product / any over a split dim: those whole first)
                args, kwargs = whole_on(odd, args, kwargs)
                ins, outs = propagate(op, args, kwargs, mesh, out_shapes, out_meta)
            if not odd_partial_axes(outs, op):
                return Decision(tuple(ins), tuple(outs), "dtensor")
        except NotImplementedError:
            pass
    source = "factory" if not tensors else "replicate"
    return Decision(tuple(_rep(ndim) for _ in tensors), (_rep(ndim),), source)
