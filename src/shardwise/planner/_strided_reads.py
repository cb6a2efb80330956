"""Ops that read a tensor through its memory strides (``as_strided`` and its kin): what they
read depends on how the tensor is laid out in memory, not only on its values.

A value the plan moves (gathered, all-reduced, cut) arrives in whatever layout the collective
left it: an AllGather along dim 1 stacks the blocks along dim 0 and permutes them into place,
so ``h.as_strided(size, stride)`` of a gathered column-parallel output read other elements than
one device's (a wrong value, no error). The executor hands such an op each moved input
contiguous (`strided_read`), which is one device's layout when the op's input was contiguous
on one device; `check_strided_read` refuses the plan when it was not (a transposed value moved
before ``as_strided``), naming the op and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardwise.planner._graph import Node, Ref
from shardwise.planner._placement import PlanError
from shardwise.planner._plan import Placed


def strided_read(op: str) -> bool:
    """Whether torch-level `op` (``"torch.Tensor.as_strided"``) reads its input by strides:
    ``as_strided``, ``as_strided_``, ``as_strided_copy``, ``as_strided_scatter``."""
    return op.rsplit(".", 1)[-1].startswith("as_strided")


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether `stride` is the row-major layout of `shape` (dims of size 1 ignored)."""
    step = 1
    for size, s in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and s != step:
            return False
        step *= size
    return True


def check_strided_read(node: Node, state: Mapping[Ref, Placed], ins: Sequence[Placed]) -> None:
    """Raise a `PlanError` when `node` reads an input by its strides (`strided_read`) that the
    plan moves (`state`: each value's placement; `ins`: the placements the node wants) and
    one device holds non-contiguous: the executor's contiguous copy would not be its layout."""
    if not strided_read(node.op) or not node.aten:
        return
    strides = {a.index: a for a in node.aten[0].args if getattr(a, "kind", None) == "in"}
    for i, (ref, dst) in enumerate(zip(node.inputs, ins, strict=True)):
        arg = strides.get(i)
        if state[ref] == dst or arg is None or _contiguous(arg.info.shape, arg.stride):
            continue
        name = node.op.rsplit(".", 1)[-1]
        raise PlanError(
            f"{node.op} at {node.source} ({node.module}) reads input {i} by its memory strides; "
            f"one device holds it non-contiguous (stride {arg.stride}, shape "
            f"{list(arg.info.shape)}), but the plan moves it ({state[ref]} -> {dst}) and a moved "
            f"value arrives contiguous, so {name} would read other elements; call "
            f".contiguous() on it before {name} (and give the strides of that layout), or use "
            f"view ops (view, reshape, narrow, unfold, transpose) instead"
        )
