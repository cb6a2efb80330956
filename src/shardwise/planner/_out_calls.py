"""Calls that write their result into ``out=`` tensors (``torch.cumsum(x, 1, out=c)``).

On one device such a call computes the op and stores the result in the tensors ``out=``
names, whose earlier contents are overwritten, not read. Capture records it as the op's own
result (`record_out`: the call with ``out=None``, a node reading only the op's inputs,
planned as any op), and the out tensors (`out_tensors`) are that node's outputs; the plan
executor runs the op the same way and stores this rank's block of the result in the
network's out tensors (`written`: resized to the block when their shape is another). A
tensor that ``out=`` aliases (``torch.exp(c, out=c)``) is read as the value it held before.

Refused with the fix (`refusal`): ``out=`` into a view of another tensor (the base would not
see the write) and a factory with ``out=`` (``torch.arange(8, out=c)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from shardwise._torch.storage import view_base
from shardwise.planner._call_kinds import call_name
from shardwise.planner._source_lines import captured_note, source_line

if TYPE_CHECKING:
    from shardwise.planner._recorders import _State

T = torch.Tensor


def out_tensors(kwargs: Mapping[str, Any]) -> list[T]:
    """The tensors a call's ``out=`` keyword names (none: an empty list).

    Example:
        >>> out_tensors({"out": c}), out_tensors({"out": (a, b)}), out_tensors({"out": None})
        ([c], [a, b], [])
    """
    out = kwargs.get("out")
    if isinstance(out, T):
        return [out]
    if isinstance(out, tuple | list):
        return [t for t in out if isinstance(t, T)]
    return []


def record_out(
    record: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
    s: _State,
    func: Callable[..., Any],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    given: list[T],
) -> Any:
    """Capture a call of `func` (its arguments `call`) storing its result in ``out=`` tensors
    `given`: `record` (the recorder's) makes the node of the call with ``out=None``; then one
    device's call on the fakes (torch's own checks, the out tensors' sizes and dtypes); the out
    tensors are that node's outputs from then on (`s`: the capture's state).

    Raises:
        CaptureError: an ``out=`` it cannot follow (`refusal`), naming the op and the fix.
    """
    from shardwise.planner._recorders import CaptureError, info_of, tensors_in

    args, kw = call
    op = call_name(func)
    inputs = len(tensors_in((args, {k: v for k, v in kw.items() if k != "out"})))
    made = tensors_in(record(func, args, {**kw, "out": None}))
    refused = refusal(op, source_line(), given, inputs, len(made))
    if refused is not None:
        raise CaptureError(refused)
    try:
        returned = func(*args, **kw)
    except RuntimeError as e:  # (``out=`` with inputs that require grad: torch's message)
        e.add_note(captured_note(op))
        raise
    s.nodes[-1] = replace(s.nodes[-1], outputs=tuple(info_of(t) for t in given))
    for t, r in zip(given, made, strict=True):
        s.known[id(t)] = s.known[id(r)]
        s.keep.append(t)
    return returned


def refusal(op: str, source: str, given: Sequence[T], inputs: int, results: int) -> str | None:
    """Why call `op` (at `source`, with out tensors `given`, `inputs` tensor inputs besides
    them and `results` tensor results of its own) cannot be planned as its result stored in
    its out tensors, or None when it can."""
    fix = f"write the result as a value of its own (c = {op}(...)) and read that"
    if any(view_base(t) is not None for t in given):
        return (
            f"{op} at {source} writes its result into a view of another tensor (out=), which "
            f"AutoParallel cannot follow (the tensor viewed would not see the write); {fix}, "
            f"and build the whole with torch.cat or torch.where"
        )
    if not inputs:
        return (
            f"{op} at {source} makes a tensor into out=, which AutoParallel supports for ops "
            f"on tensors, not for factories; {fix}"
        )
    if results != len(given):
        return (
            f"{op} at {source} gives {results} tensors but its out= names {len(given)}, which "
            f"AutoParallel cannot pair; {fix}"
        )
    return None


def written(given: Any, result: Any) -> Any:
    """The out tensors of a call (``out=`` `given`), holding `result`, this rank's blocks of
    the op's result (each resized to its block first when its shape is another), as the call
    returns them (one tensor, or the op's tuple type)."""
    outs = out_tensors({"out": given})
    results = [result] if isinstance(result, T) else [t for t in result if isinstance(t, T)]
    with torch.no_grad():
        for into, block in zip(outs, results, strict=True):
            if into.shape != block.shape:
                into.resize_(block.shape)
            into.copy_(block)
    if isinstance(result, T):
        return outs[0]
    return type(result)(outs)
