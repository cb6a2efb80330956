"""Spec builders: one primitive call (arguments + global input shapes) -> its `Spec`.

One builder per family, each ``builder(op_args, shapes, who) -> Spec``:

- `matmul_spec`: MatMul / BatchMatMul (transpose flags, broadcast batch dims; K summed).
- `broadcast_spec`: Add / Sub / Mul / Div (NumPy broadcasting; broadcast dims never split).
- `unary_spec`: ReLU / GeLU / Sigmoid / Tanh / Exp / Log / Cast / Dropout (Dropout: 2 outputs,
  ``local="random"``).
- `softmax_spec`: Softmax / LogSoftmax (the axis may not be split).
- `bias_add_spec`, `layer_norm_spec`, `softmax_ce_spec`, `gather_spec`.
- `reduce_spec`: ReduceSum / ReduceMean / ReduceMax (a split reduced dim -> AllReduce sum /
  mean / max).
- `transpose_spec`, `reshape_spec` (Reshape and Flatten; `_reshape_groups` finds merged dims).

Builders validate shapes and arguments and raise ValueError naming `who`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from shardwise.layout import elementwise_axes
from shardwise.ops._plan import ReduceKind, Shape
from shardwise.ops._spec import Dims, Spec

SpecBuilder: TypeAlias = Callable[[Mapping[str, Any], Sequence[Shape], str], Spec]


def _arity(op: str, shapes: Sequence[Shape], names: tuple[str, ...], who: str) -> None:
    if len(shapes) != len(names):
        raise ValueError(
            f"{who}: {op} takes {len(names)} tensor inputs ({', '.join(names)}), "
            f"got {len(shapes)} shapes"
        )


def norm_axis(axis: object, rank: int, who: str, what: str = "axis") -> int:
    """`axis` in ``[-rank, rank)`` (a 0-dim tensor: -1 or 0, as torch takes them) as a
    non-negative index, else ValueError naming `who`; any integer type (a numpy int)."""
    low, high = (-1, 1) if rank == 0 else (-rank, rank)
    try:
        value = None if isinstance(axis, bool) else operator.index(axis)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or not low <= value < high:
        raise ValueError(f"{who}: {what}={axis!r} is not an int in [{low}, {high})")
    return value % rank if rank else 0


def axes_of(axis: object, rank: int, who: str) -> tuple[int, ...]:
    """`axis` (an int or a tuple / list of ints) as sorted non-negative dims, else ValueError
    naming `who` (out of range, not an int, a dim twice)."""
    values = list(axis) if isinstance(axis, tuple | list) else [axis]
    out = tuple(sorted({norm_axis(a, rank, who) for a in values}))
    if len(out) != len(values):
        raise ValueError(f"{who}: axis={axis!r} repeats a dim")
    return out


def norm_perm(perm: object, rank: int, who: str) -> tuple[int, ...]:
    """A Transpose's `perm` with negative entries counted from the end (MindSpore takes
    ``[-rank, rank)``), else ValueError naming `who` when it is not a permutation."""
    try:
        values = list(perm)  # type: ignore[call-overload]
    except TypeError:
        values = [perm]
    try:
        out = tuple(norm_axis(p, rank, who, "perm entry") for p in values)
    except ValueError:
        out = ()
    if sorted(out) != list(range(rank)):
        raise ValueError(f"{who}: perm {perm} is not a permutation of the {rank} dims")
    return out


def broadcast_shapes(shapes: Sequence[Shape], who: str) -> Shape:
    """NumPy broadcasting of `shapes`, else ValueError naming `who`."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for d, size in enumerate(shape):
            k = rank - len(shape) + d
            if size != 1 and out[k] not in (1, size):
                raise ValueError(f"{who}: shapes {[list(s) for s in shapes]} do not broadcast")
            out[k] = max(out[k], size)
    return tuple(out)


def matmul_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """``[..., M, K] x [..., K, N] -> [..., M, N]``: axes batch..., M, K, N (K summed)."""
    op = str(op_args["op"])
    names = ("x", "w") if op == "MatMul" else ("x", "y")
    _arity(op, shapes, names, who)
    x, w = shapes
    ta, tb = bool(op_args.get("transpose_a", False)), bool(op_args.get("transpose_b", False))
    if op == "MatMul" and (len(x) != 2 or len(w) != 2):
        raise ValueError(f"{who}: MatMul takes 2-D inputs, got {list(x)} and {list(w)}")
    if len(x) < 2 or len(w) < 2:
        raise ValueError(f"{who}: {op} takes inputs of >= 2 dims, got {list(x)} and {list(w)}")
    k_x, k_w = (x[-2] if ta else x[-1]), (w[-1] if tb else w[-2])
    if k_x != k_w:
        raise ValueError(
            f"{who}: contracted dims differ: x {list(x)} has K={k_x}, the other {list(w)} K={k_w} "
            f"(transpose_a={ta}, transpose_b={tb})"
        )
    batch = broadcast_shapes([x[:-2], w[:-2]], who)
    nb = len(batch)
    m, k, n = nb, nb + 1, nb + 2

    def batch_ids(b: Shape) -> list[int | None]:
        off = nb - len(b)
        return [None if s == 1 and batch[off + j] > 1 else off + j for j, s in enumerate(b)]

    x_ids = (*batch_ids(x[:-2]), *((k, m) if ta else (m, k)))
    w_ids = (*batch_ids(w[:-2]), *((n, k) if tb else (k, n)))
    out_shape = (*batch, x[-1] if ta else x[-2], w[-2] if tb else w[-1])
    roles = {j: f"batch dim {j}" for j in range(nb)}
    roles.update({m: "the row dim M", k: "the contracted dim K", n: "the column dim N"})
    return Spec(
        op,
        names,
        (x_ids, w_ids),
        ((*range(nb), m, n),),
        (out_shape,),
        reduced=(k,),
        roles=roles,
        scatter=True,
        batch=0,
    )


def broadcast_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Binary elementwise ops: the output dims are the logical axes; inputs right-aligned."""
    op = str(op_args["op"])
    _arity(op, shapes, ("x", "y"), who)
    out = broadcast_shapes(shapes, who)
    ids = tuple(tuple(a) for a in elementwise_axes(shapes))
    return Spec(op, ("x", "y"), ids, (tuple(range(len(out))),), (out,), batch=0)


def unary_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """One input, same-shaped output(s); Dropout also returns its mask (same layout)."""
    op = str(op_args["op"])
    names = ("input_x",) if op == "Cast" else ("x",)
    _arity(op, shapes, names, who)
    ids = tuple(range(len(shapes[0])))
    count = 2 if op == "Dropout" else 1
    return Spec(
        op,
        names,
        (ids,),
        (ids,) * count,
        (tuple(shapes[0]),) * count,
        local="random" if op == "Dropout" else "",
    )


def softmax_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Softmax / LogSoftmax: unary, and the softmax axis (or axes) may not be split."""
    spec = unary_spec(op_args, shapes, who)
    axis = op_args.get("axis", -1)
    fixed = {
        a: f"is the {spec.op} axis (axis={axis!r})" for a in axes_of(axis, len(shapes[0]), who)
    }
    return Spec(
        spec.op, spec.input_names, spec.inputs, spec.outputs, spec.output_shapes, fixed=fixed
    )


def bias_add_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """``x + bias`` on the channel dim (dim 1 for NCHW / NCDHW, the last for NHWC)."""
    _arity("BiasAdd", shapes, ("input_x", "bias"), who)
    x, bias = shapes
    fmt = str(op_args.get("data_format", "NCHW"))
    if len(x) < 2:
        raise ValueError(f"{who}: BiasAdd needs input_x of >= 2 dims, got {list(x)}")
    c = len(x) - 1 if fmt == "NHWC" else 1
    if len(bias) != 1 or bias[0] != x[c]:
        raise ValueError(
            f"{who}: bias must have shape [{x[c]}] (the channel dim), got {list(bias)}"
        )
    ids = tuple(range(len(x)))
    return Spec(
        "BiasAdd",
        ("input_x", "bias"),
        (ids, (c,)),
        (ids,),
        (tuple(x),),
        roles={c: "the channel dim"},
    )


def layer_norm_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """LayerNorm: outputs (y, mean, rstd); dims from begin_norm_axis on may not be split."""
    names = ("input_x", "gamma", "beta")
    _arity("LayerNorm", shapes, names, who)
    x = shapes[0]
    r = len(x)
    bna = norm_axis(op_args.get("begin_norm_axis", 1), r, who, "begin_norm_axis")
    bpa = norm_axis(op_args.get("begin_params_axis", 1), r, who, "begin_params_axis")
    for name, shape in zip(names[1:], shapes[1:], strict=True):
        if tuple(shape) != tuple(x[bpa:]):
            raise ValueError(
                f"{who}: {name} must have shape input_x[begin_params_axis:] = {list(x[bpa:])}, "
                f"got {list(shape)}"
            )
    ids = tuple(range(r))
    stats: Dims = (*ids[:bna], *([None] * (r - bna)))
    stats_shape = (*x[:bna], *([1] * (r - bna)))
    fixed = {k: f"is normalized by LayerNorm (begin_norm_axis={bna})" for k in range(bna, r)}
    return Spec(
        "LayerNorm",
        names,
        (ids, ids[bpa:], ids[bpa:]),
        (ids, stats, stats),
        (tuple(x), stats_shape, stats_shape),
        fixed=fixed,
    )


_REDUCE_OPS: dict[str, ReduceKind] = {"ReduceMean": "mean", "ReduceMax": "max"}


def reduce_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """ReduceSum / ReduceMean / ReduceMax over `axis` (``()``: every dim, unless skip_mode)."""
    op = str(op_args["op"])
    _arity(op, shapes, ("x",), who)
    x = shapes[0]
    axis = op_args.get("axis", ())
    axes = axes_of(axis, len(x), who) if axis not in ((), []) else ()
    if not axes and not op_args.get("skip_mode", False):
        axes = tuple(range(len(x)))
    keep = bool(op_args.get("keep_dims", False))
    ids = tuple(range(len(x)))
    out: Dims = (
        tuple(None if k in axes else k for k in ids)
        if keep
        else tuple(k for k in ids if k not in axes)
    )
    shape = tuple(1 if k in axes else s for k, s in enumerate(x) if keep or k not in axes)
    return Spec(
        op,
        ("x",),
        (ids,),
        (out,),
        (shape,),
        reduced=axes,
        reduce_op=_REDUCE_OPS.get(op, "sum"),
    )


def softmax_ce_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """(logits [N, C], labels [N, C]) -> (loss [N], backprop [N, C]); C may not be split."""
    names = ("logits", "labels")
    _arity("SoftmaxCrossEntropyWithLogits", shapes, names, who)
    logits, labels = shapes
    if len(logits) != 2 or tuple(labels) != tuple(logits):
        raise ValueError(
            f"{who}: logits and labels must both have shape [N, C], got {list(logits)} and "
            f"{list(labels)}"
        )
    return Spec(
        "SoftmaxCrossEntropyWithLogits",
        names,
        ((0, 1), (0, 1)),
        ((0,), (0, 1)),
        ((logits[0],), tuple(logits)),
        fixed={1: "is the class dim (softmax over it)"},
    )


def gather_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Gather: out = params[:axis] + indices[batch_dims:] + params[axis+1:]; the params' axis
    dim is summed over when split (each rank looks up only its own rows)."""
    names = ("input_params", "input_indices")
    _arity("Gather", shapes, names, who)
    params, indices = shapes
    p, q = len(params), len(indices)
    if p == 0:
        raise ValueError(f"{who}: input_params must have at least 1 dim")
    axis = norm_axis(op_args.get("axis"), p, who)
    b = int(op_args.get("batch_dims", 0))
    if not 0 <= b <= min(axis, q) or tuple(params[:b]) != tuple(indices[:b]):
        raise ValueError(
            f"{who}: batch_dims={b} needs params[:{b}] == indices[:{b}] and batch_dims <= axis "
            f"(params {list(params)}, indices {list(indices)}, axis {axis})"
        )
    idx = (*range(b), *range(p, p + q - b))
    out = (*range(axis), *idx[b:], *range(axis + 1, p))
    shape = (*params[:axis], *indices[b:], *params[axis + 1 :])
    roles = {axis: f"the gathered axis {axis}", **{k: f"batch dim {k}" for k in range(b)}}
    fixed = {axis: f"is the gathered axis {axis} (batch_dims={b})"} if b else {}
    return Spec(
        "Gather",
        names,
        (tuple(range(p)), idx),
        (out,),
        (shape,),
        reduced=(axis,),
        fixed=fixed,
        roles=roles,
        scatter=axis == 0,
        local="masked_lookup",
        batch=idx[0] if q else -1,
    )


def transpose_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Transpose: output dim k is input dim perm[k] (same split)."""
    _arity("Transpose", shapes, ("x",), who)
    x = shapes[0]
    perm = norm_perm(op_args.get("perm", ()), len(x), f"{who} on {list(x)}")
    return Spec("Transpose", ("x",), (tuple(range(len(x))),), (perm,), (tuple(x[k] for k in perm),))


def resolve_shape(shape: Sequence[int], numel: int, who: str) -> Shape:
    """A Reshape target with its ``-1`` filled in, else ValueError naming `who`."""
    known = math.prod(s for s in shape if s != -1)
    out = [numel // known if s == -1 and known else s for s in shape]
    if sum(s == -1 for s in shape) > 1 or any(s < 0 for s in out) or math.prod(out) != numel:
        raise ValueError(f"{who}: cannot reshape {numel} elements into {list(shape)}")
    return tuple(out)


def _reshape_groups(src: Shape, dst: Shape) -> list[tuple[list[int], list[int]]]:
    """Runs of consecutive dims (size-1 dims skipped) with equal products, as (src, dst) dims."""
    si = [k for k, s in enumerate(src) if s != 1]
    di = [k for k, s in enumerate(dst) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(si) and j < len(di):
        gi, gj = [si[i]], [di[j]]
        ps, pd = src[si[i]], dst[di[j]]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(si[i])
                ps, i = ps * src[si[i]], i + 1
            else:
                gj.append(di[j])
                pd, j = pd * dst[di[j]], j + 1
        groups.append((gi, gj))
    return groups


def _reshape(op: str, x: Shape, out: Shape, who: str) -> Spec:
    """Each run of merged/split dims keeps the split of its outermost input dim, which goes to
    its outermost output dim; the other input dims of the run may not be split."""
    ids = tuple(range(len(x)))
    out_ids: list[int | None] = [None] * len(out)
    fixed: dict[int, str] = {}
    if 0 in x:
        fixed = {k: "belongs to an empty tensor" for k in ids}
    for gi, gj in [] if 0 in x else _reshape_groups(x, out):
        out_ids[gj[0]] = gi[0]
        for k in gi[1:]:
            fixed[k] = (
                f"is reshaped together with input dim {gi[0]} into output dim(s) {gj} (only the "
                f"outermost input dim of such a run may be split)"
            )
    return Spec(op, ("x",), (ids,), (tuple(out_ids),), (out,), fixed=fixed)


def reshape_spec(op_args: Mapping[str, Any], shapes: Sequence[Shape], who: str) -> Spec:
    """Reshape to ``op_args["shape"]``; Flatten: ``[N, ...] -> [N, prod(...)]`` (see `_reshape`
    for the supported splits)."""
    op = str(op_args["op"])
    _arity(op, shapes, ("x",), who)
    x = tuple(shapes[0])
    if op == "Flatten":
        if not x:
            raise ValueError(f"{who}: Flatten needs an input of >= 1 dim")
        return _reshape(op, x, (x[0], math.prod(x[1:])), who)
    target = op_args.get("shape")
    if not isinstance(target, tuple | list):
        raise ValueError(f"{who}: Reshape needs a target shape (tuple of ints), got {target!r}")
    return _reshape(op, x, resolve_shape(target, math.prod(x), who), who)
