"""The layouts users pin on torch ops and values: ``sw.reshard`` nodes and op-form ``sw.shard``.

- `reshard_layout`: a ``"shardwise.reshard"`` node's layout (its entry resolved for the value's
  global shape and the job's size).
- `op_form`: the layouts an op-form strategy gives an annotated op's tensor inputs, on the op's
  own device matrix. ``nn.Linear``'s ``F.linear(x, weight, bias)`` is read as
  ``MatMul(transpose_b=True)`` reads its strategy (``x`` as ``(rows, in_features)``, rows being
  dim 0; the weight's output features may be strided, ``sw.strided``); ``nn.Embedding``'s
  ``F.embedding(ids, weight)`` with the ids' dims on the first axes of the op's matrix and the
  embedding dim on the last. The planner then follows the op's aten program from these layouts
  (the bias, the output and any partial sums come from the sharding rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.layout import DeviceMatrix, TensorLayout, resolve_strategy
from shardwise.ops import MatMul, normalize_entry, plan_primitive
from shardwise.ops._spec_checks import layout_call
from shardwise.planner._graph import Graph, Node

Shape = tuple[int, ...]
RESHARD = "shardwise.reshard"
LINEAR = "torch.nn.functional.linear"
EMBEDDING = "torch.nn.functional.embedding"


class AnnotationError(ValueError):
    """An ``sw.shard`` / ``sw.reshard`` annotation that does not fit its op or the job."""


def entry_layout(entry: Any, shape: Shape, device_num: int, who: str) -> TensorLayout:
    """One tensor's strategy entry (split counts, the repeat appended on the right; or a Layout
    call) as a `TensorLayout` for a tensor of global `shape` in a job of `device_num`.

    Raises:
        AnnotationError / LayoutTypeError: a malformed entry, or one that does not fit.
    """
    one = normalize_entry(entry, "layout", who)
    ndim = one.ndim if isinstance(one, TensorLayout) else len(one)
    if ndim != len(shape):
        raise AnnotationError(
            f"{who}: the layout {one} has {ndim} dims but the tensor has shape {list(shape)}; "
            f"give one entry per tensor dim"
        )
    found = resolve_strategy((one,), device_num, who=who)  # type: ignore[arg-type]
    layout = found.layouts[0]
    layout.check(shape, who)  # (the one tensor: no "input 0" in its messages)
    return layout


def reshard_layout(node: Node, shape: Shape, device_num: int) -> TensorLayout:
    """The layout a ``sw.reshard`` node pins (checked against the value's global `shape`),
    named in messages as its node says: ``sw.reshard``, or the ``sw.shard`` call and its
    strategy entry (``sw.shard(f) in attn at file:line: in_strategy entry 1 (key)``)."""
    args = {**dict(zip(("tensor", "entry", "who", "what"), node.args, strict=False)), **node.kwargs}
    who = args.get("who", "sw.reshard")
    if who != "sw.reshard" and node.module:  # (the module it is, or is called in)
        who += f" in {node.module}"
    who += f" at {node.source}"
    if args.get("what"):
        who += f": {args['what']}"
    return entry_layout(args["entry"], shape, device_num, who)


def op_form(
    node: Node, graph: Graph, device_num: int
) -> tuple[DeviceMatrix, dict[int, TensorLayout]]:
    """The op's device matrix and the layout of each annotated input slot.

    Raises:
        AnnotationError: the op is not one the op form knows, or the strategy does not fit.
    """
    assert node.strategy is not None
    shapes = [graph.info(r).shape for r in node.inputs]
    who = f"sw.shard on {_module_name(node)} ({node.op} at {node.source})"
    if node.op == LINEAR:
        return _linear(node.strategy, shapes, device_num, who)
    if node.op == EMBEDDING:
        return _embedding(node.strategy, shapes, device_num, who)
    raise AnnotationError(
        f"{who}: the op form of sw.shard annotates F.linear (nn.Linear) or F.embedding "
        f"(nn.Embedding), not {node.op}; reshard the module's inputs instead"
    )


def _module_name(node: Node) -> str:
    """The annotated module as messages name it: its path, or its kind when it is the top
    level (the network itself, or a module the step calls that belongs to no network)."""
    if node.module:
        return node.module
    kind = {LINEAR: "nn.Linear", EMBEDDING: "nn.Embedding"}.get(node.op, "module")
    return f"the top-level {kind}"


def _linear(
    strategy: Sequence[Any], shapes: Sequence[Shape], device_num: int, who: str
) -> tuple[DeviceMatrix, dict[int, TensorLayout]]:
    x, w = shapes[0], shapes[1]
    if len(x) < 2:
        raise AnnotationError(f"{who}: the op form needs an input of 2 or more dims, got {list(x)}")
    _two_values_each(strategy, x, who)
    rows = 1
    for s in x[:-1]:
        rows *= s
    groups = _strided_weight_rows(strategy, who)
    plain = tuple(e.plain() if isinstance(e, TensorLayout) else e for e in strategy)
    mm = MatMul(transpose_b=True).shard(plain)
    mm.module_path = who
    try:
        op = plan_primitive(mm, (rows, x[-1]), w, device_num=device_num)
    except ValueError as e:
        raise AnnotationError(f"{e} (nn.Linear read as MatMul(transpose_b=True))") from None
    x2d, weight = op.inputs[0], op.inputs[1]
    if x[0] % x2d.split_count(0):
        raise AnnotationError(_rows_uneven(who, x, x2d.split_count(0)))
    dims = (x2d.dims[0],) + ((),) * (len(x) - 2) + (x2d.dims[1],)
    if groups > 1:
        weight = TensorLayout(op.matrix, weight.dims, (groups, 1))
        weight.check(w, f"{who}: input 1 (weight)")
    return op.matrix, {0: TensorLayout(op.matrix, dims), 1: weight}


def _rows_uneven(who: str, x: Shape, count: int) -> str:
    """The message for an input whose dim 0 the op form's row split (`count` ways) does not
    divide: the op form splits dim 0 whatever the input's layout, which is the sequence in a
    sequence-first input (``nn.TransformerEncoderLayer``'s default, ``batch_first=False``)."""
    return (
        f"{who}: the op form splits dim 0 of the input (nn.Linear's rows) {count} ways, but "
        f"input 0 (x), shape {list(x)}, has {x[0]} entries in dim 0, which {count} does not "
        f"divide. A sequence-first input (torch's "
        f"nn.TransformerEncoderLayer / nn.MultiheadAttention default, batch_first=False) has "
        f"the sequence there, not the batch: build those modules with batch_first=True, or "
        f"give the input a dim 0 divisible by {count}"
    )


def _two_values_each(strategy: Sequence[Any], x: Shape, who: str) -> None:
    """nn.Linear's op form reads its input as ``(rows, in_features)`` whatever the input's
    rank, and its weight as ``(out_features, in_features)``: two values per entry.

    Raises:
        AnnotationError: an entry of another length, naming the reading and the fix.
    """
    reads = (
        f"input 0 (x): (rows, in_features) whatever the input's rank (rows: its dim 0; this "
        f"input has shape {list(x)})",
        "input 1 (weight): (out_features, in_features)",
    )
    for i, entry in enumerate(strategy[:2]):
        plain = isinstance(entry, tuple | list)
        n = len(entry) if plain else entry.ndim
        if n == 2:
            continue
        fix = "give 2"
        if plain and n > 2:
            fix += f", e.g. {(entry[0], entry[-1])}"
        raise AnnotationError(
            f"{who}: nn.Linear's op form takes 2 entries for {reads[i]}; its strategy "
            f"{_show(entry)} has {n}; {fix}"
        )


def _show(entry: Any) -> str:
    return layout_call(entry) if isinstance(entry, TensorLayout) else str(tuple(entry))


def _strided_weight_rows(strategy: Sequence[Any], who: str) -> int:
    """The strided group count of an ``nn.Linear`` strategy: only the weight's output features
    (its dim 0, e.g. ``layout(sw.strided("mp", 3), "None")`` for a fused q/k/v projection) may
    be strided; the output then is strided alike (the sharding rules carry it on).

    Raises:
        AnnotationError: a strided dim anywhere else.
    """
    for i, entry in enumerate(strategy):
        if not isinstance(entry, TensorLayout) or not entry.strided:
            continue
        bad = [d for d in range(entry.ndim) if entry.groups_of(d) > 1 and (i, d) != (1, 0)]
        if bad:
            raise AnnotationError(
                f"{who}: input {i} dim {bad[0]} is strided ({entry}); nn.Linear's op form takes "
                f"a strided split only on the weight's output features (input 1 dim 0), e.g. "
                f"layout(sw.strided('mp', 3), 'None') for a fused q/k/v projection"
            )
    weight = strategy[1] if len(strategy) > 1 else None
    return weight.groups_of(0) if isinstance(weight, TensorLayout) else 1


def _embedding(
    strategy: Sequence[Any], shapes: Sequence[Shape], device_num: int, who: str
) -> tuple[DeviceMatrix, dict[int, TensorLayout]]:
    """``F.embedding(ids, weight)``: ids dims on the first axes, the embedding dim on the
    last (MindSpore's order: the outer axes split the batch)."""
    ids = shapes[0]
    vocab = f"{who}: splitting the vocabulary (the weight's dim 0) is not supported by "
    vocab += "nn.Embedding's op form; split the embedding dim instead"
    if isinstance(strategy[1], tuple) and len(strategy[1]) == 2:  # (the same devices, moved)
        moved = (tuple(strategy[0]), (1, strategy[1][0] * strategy[1][1]))
        vocab += f", e.g. {moved}"
    vocab += ", or use sw.ops.Gather"
    if isinstance(strategy[1], tuple) and strategy[1][0] != 1:
        raise AnnotationError(vocab)
    axes: list[list[int | None]] = [list(range(len(ids))), [None, len(ids)]]
    names = ("ids", "weight")
    for i, (entry, shape) in enumerate(zip(strategy, shapes, strict=False)):
        if isinstance(entry, TensorLayout) and entry.ndim != len(shape):
            raise AnnotationError(
                f"{who}: input {i} ({names[i]}) has {len(shape)} dims (shape {list(shape)}) but "
                f"its Layout call {layout_call(entry)} has {entry.ndim}; give one alias or 'None' "
                "per dim"
            )
    try:
        found = resolve_strategy(
            tuple(strategy), device_num, axes, shapes=shapes, who=who, input_names=names
        )
    except ValueError as e:
        raise AnnotationError(str(e)) from None
    index, weight = found.layouts[0], found.layouts[1]
    if weight.dims[0]:
        raise AnnotationError(vocab)
    _one_dim_per_axis(index, weight, who)
    return found.matrix, {0: index, 1: weight}


def _one_dim_per_axis(ids: TensorLayout, weight: TensorLayout, who: str) -> None:
    """An axis splitting the ids and the embedding dim would split the output's dims twice
    (Layout calls only: split counts give each dim its own axis)."""
    matrix = ids.matrix
    on_ids = {a: d for d in range(ids.ndim) for a in ids.dims[d] if matrix.shape[a] > 1}
    both = [a for a in weight.dims[1] if a in on_ids]
    if both:
        a = both[0]
        raise AnnotationError(
            f"{who}: device axis {matrix.names[a]!r} splits both input 0 (ids) dim {on_ids[a]} "
            "and input 1 (weight) dim 1 (the embedding dim); one device axis can split only "
            "one of the op's dims; use another axis or 'None' for one of them"
        )
