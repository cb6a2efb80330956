"""Ops that read a tensor through its memory strides (``as_strided`` and its kin): what they
read depends on how the tensor is laid out in memory, not only on its values.

A value the plan moves (gathered, all-reduced, cut) arrives in whatever layout the collective
left it: an AllGather along dim 1 stacks the blocks along dim 0 and permutes them into place,
so ``h.as_strided(size, stride)`` of a gathered column-parallel output read other elements than
one device's (a wrong value, no error). The executor hands such an op each moved input
contiguous (`strided_read`), which is one device's layout when the op's input was contiguous
on one device; `check_strided_read` refuses the plan when it was not (a transposed value moved
before ``as_strided``), naming the op and the fix.

The copy also starts at storage offset 0 and holds only the input's own elements, so one
device's read is the copy's only when it stays inside the input (`_outside`): a storage_offset
passed to the op while the input itself starts at a nonzero offset (a view such as ``x[2:]``:
one device counts it from its base's storage, the copy from its own first element), or sizes
and strides reaching past the input's elements (one device reads its base's storage there)
are refused too, naming the op and the fix. Such a call of the user's own is planned replicated
(`own_strided_call`), whatever the rule of an ``as_strided`` a kernel makes from its local
tensor says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.planner._graph import AtenArg, AtenCall, Node, Ref
from shardwise.planner._placement import PlanError
from shardwise.planner._plan import Placed


def strided_read(op: str) -> bool:
    """Whether torch-level `op` (``"torch.Tensor.as_strided"``) reads its input by strides:
    ``as_strided``, ``as_strided_``, ``as_strided_copy``, ``as_strided_scatter``."""
    return op.rsplit(".", 1)[-1].startswith("as_strided")


def own_strided_call(node: Node, call: AtenCall) -> bool:
    """Whether aten `call` is `node`'s own strided read (a user's ``h.as_strided(size,
    stride)``, whose sizes may be the global ones: run replicated), not one a kernel makes from
    its local tensor (``adaptive_avg_pool2d``'s restride of a channels-last mean: its rule,
    `ops.aten_rules.restride_rule`, may keep the input's split)."""
    return strided_read(node.op) and strided_read(str(call.op).rsplit(".", 1)[0])


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether `stride` is the row-major layout of `shape` (dims of size 1 ignored)."""
    step = 1
    for size, s in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and s != step:
            return False
        step *= size
    return True


def _bound(call: AtenCall) -> dict[str, Any]:
    """The aten call's arguments by their schema names (``self``, ``size``, ``stride``,
    ``storage_offset``)."""
    names = [a.name for a in call.op._schema.arguments]
    return {**dict(zip(names, call.args, strict=False)), **call.kwargs}


def _outside(arg: AtenArg, call: AtenCall, name: str) -> str | None:
    """Why `call`'s read of its strided input `arg` on one device is not the same read of a
    contiguous copy of `arg` at storage offset 0, and the fix (None: it is)."""
    bound = _bound(call)
    size, stride, offset = bound.get("size"), bound.get("stride"), bound.get("storage_offset")
    if size is None or stride is None:
        return None
    if offset is not None and arg.offset != 0:
        return (
            f"it passes storage_offset={offset}, which one device counts from the storage of "
            f"a view that starts at storage offset {arg.offset} and the moved copy from its "
            f"first element; call .clone() on it before {name} (a tensor of its own, at "
            f"storage offset 0) and give the offset from its first element, or omit "
            f"storage_offset"
        )
    if any(n == 0 for n in size):
        return None  # reads nothing
    start = (offset if offset is not None else arg.offset) - arg.offset
    low = start + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if s < 0)
    high = start + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if s > 0)
    numel = 1
    for n in arg.info.shape:
        numel *= n
    if low < 0 or high >= numel:
        return (
            f"its sizes {list(size)} and strides {list(stride)} (from element {start}) reach "
            f"elements {low}..{high} of an input of {numel}: one device reads its base's "
            f"storage there, the moved copy holds only its own {numel} elements; apply {name} "
            f"to the tensor whose elements it reads (the view's base), with sizes and strides "
            f"inside it"
        )
    return None


def check_strided_read(node: Node, state: Mapping[Ref, Placed], ins: Sequence[Placed]) -> None:
    """Raise a `PlanError` when `node` reads an input by its strides (`strided_read`) that the
    plan moves (`state`: each value's placement; `ins`: the placements the node wants) and
    one device holds non-contiguous, or reads outside its own elements (`_outside`): the
    executor's contiguous copy at storage offset 0 would not be its layout."""
    if not strided_read(node.op) or not node.aten:
        return
    call = node.aten[0]
    strides = {a.index: a for a in call.args if getattr(a, "kind", None) == "in"}
    source = _bound(call).get("self")
    name = node.op.rsplit(".", 1)[-1]
    for i, (ref, dst) in enumerate(zip(node.inputs, ins, strict=True)):
        arg: AtenArg | None = strides.get(i)
        if arg is None or state[ref] == dst:
            continue
        where = f"{node.op} at {node.source} ({node.module}) reads input {i} by its memory strides"
        moved = f"the plan moves it ({state[ref]} -> {dst}) and a moved value arrives contiguous"
        if not _contiguous(arg.info.shape, arg.stride):
            raise PlanError(
                f"{where}; one device holds it non-contiguous (stride {arg.stride}, shape "
                f"{list(arg.info.shape)}), but {moved}, so {name} would read other elements; "
                f"call .contiguous() on it before {name} (and give the strides of that layout), "
                f"or use view ops (view, reshape, narrow, unfold, transpose) instead"
            )
        strided_input = arg is source  # (as_strided_scatter's src is read whole)
        why = _outside(arg, call, name) if strided_input else None
        if why is not None:
            raise PlanError(
                f"{where}, but {moved} at storage offset 0, so {name} would read other "
                f"elements: {why}; or use view ops (view, reshape, narrow, unfold, transpose)"
            )
