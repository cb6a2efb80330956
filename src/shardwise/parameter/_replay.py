"""Replaying a session's tape to compute real values for deferred tensors.

The rule: the tape is replayed *in recording order*, starting from the generator states
captured when the ``no_init_parameters`` block was entered, with every recorded reseed
re-applied at its place. Random numbers are therefore drawn in exactly the order eager
construction would have drawn them, so values are bit-identical to an eager build after
the same ``torch.manual_seed``.

- `Target`: a deferred tensor to compute (its name, object and view of a root).
- `compute`: run the tape once; each root is kept only until its last use, at which point
  the targets viewing it are extracted (whole, or ``slicer(name, shape)``-sliced and
  copied); returns the values in target order. A sliced root that ``_blocks.plan_blocks``
  accepts lives as its block only: its entries run as lowered steps on the block (random
  fills drawn in chunks), so it never exists whole. A target changed in place after the
  block (``Session.changed``: the tape does not hold that change) is refused first.
- `_rng_scope`: generator bookkeeping. Afterwards the generators are left where eager
  construction would have left them if nobody drew random numbers since the block was
  exited; otherwise they are restored to what they were (the caller's stream is untouched).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.parameter import _rng
from shardwise.parameter._blocks import (
    DEFAULT_CHUNK_BYTES,
    BlockPlan,
    Slicer,
    plan_blocks,
    run_steps,
)
from shardwise.parameter._errors import DeferredInitError
from shardwise.parameter._tape import RecordedOp, RngReset, Session, TensorRef, flatten


@dataclass(frozen=True)
class Target:
    """A deferred tensor to materialize: its reporting name, the object, and its view."""

    name: str
    tensor: torch.Tensor
    ref: TensorRef


def _view(root: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if root.dtype != ref.dtype:
        raise DeferredInitError(
            f"a view reinterpreting {root.dtype} as {ref.dtype} cannot be replayed"
        )
    return torch.as_strided(root, ref.size, ref.stride, ref.offset)


def _decode(value: Any, real: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, TensorRef):
        return _view(real[value.key], value)
    if type(value) is tuple or type(value) is list:
        return type(value)(_decode(item, real) for item in value)
    if type(value) is dict:
        return {name: _decode(item, real) for name, item in value.items()}
    return value


def _iter_refs(value: Any) -> Iterator[TensorRef]:
    if isinstance(value, TensorRef):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _iter_refs(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _iter_refs(item)


def _restride(tensor: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """``tensor`` laid out exactly as recorded on meta (copied only when it differs)."""
    same = (
        tuple(tensor.shape) == ref.size
        and tuple(tensor.stride()) == ref.stride
        and tensor.storage_offset() == ref.offset
        and tensor.dtype == ref.dtype
    )
    if same:
        return tensor
    extent = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride, strict=True)) + 1
    base = torch.empty(
        extent if all(ref.size) else ref.offset, dtype=ref.dtype, device=tensor.device
    )
    view = torch.as_strided(base, ref.size, ref.stride, ref.offset)
    view.copy_(tensor)
    return view


def _run(op: RecordedOp, real: dict[int, torch.Tensor]) -> None:
    out = op.func(*_decode(op.args, real), **_decode(op.kwargs, real))
    if op.outputs:
        leaves = flatten(out)
        for index, ref in op.outputs:
            real[ref.key] = _restride(leaves[index], ref)


def _free_schedule(tape: list[RecordedOp | RngReset]) -> dict[int, list[int]]:
    """Tape index -> root keys whose last use is that entry."""
    last: dict[int, int] = {}
    for index, entry in enumerate(tape):
        if isinstance(entry, RecordedOp):
            for ref in _iter_refs((entry.args, entry.kwargs, [r for _, r in entry.outputs])):
                last[ref.key] = index
    schedule: dict[int, list[int]] = {}
    for key, index in last.items():
        schedule.setdefault(index, []).append(key)
    return schedule


@contextmanager
def _rng_scope(session: Session) -> Iterator[None]:
    before = {device: _rng.get_state(device) for device in session.entry_states}
    for device, state in session.entry_states.items():
        _rng.set_state(device, state)
    try:
        yield
    except BaseException:
        for device, state in before.items():
            _rng.set_state(device, state)
        raise
    for device, state in before.items():
        untouched = device in session.exit_states and torch.equal(
            state, session.exit_states[device]
        )
        if not untouched:
            _rng.set_state(device, state)


def _extract(
    root: torch.Tensor, target: Target, slicer: Slicer | None, device: torch.device | None
) -> torch.Tensor:
    value = _view(root, target.ref)
    index = slicer(target.name, tuple(value.shape)) if slicer is not None else None
    if index is not None:
        value = value[index].clone(memory_format=torch.contiguous_format)
    if device is not None:
        value = value.to(device)
    return value


def check_unchanged(session: Session, targets: list[Target]) -> None:
    """Raise DeferredInitError naming the `targets` of `session` changed in place after its
    block."""
    changed = sorted({t.name or "<tensor>" for t in targets if session.changed(t.ref.key)})
    if changed:
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise DeferredInitError(
            f"materialize: {', '.join(changed[:4])}{more} changed in place after the "
            "sw.no_init_parameters() block (nn.init.*_, fill_, copy_, load_state_dict...): "
            "only changes made inside the block are recorded, so materializing would lose "
            "the change; "
            "make the change inside the block, or after materialize(net) or the network's "
            "first call (a checkpoint: sw.load_param_into_net, which fills deferred entries)"
        )


def compute(
    session: Session,
    targets: list[Target],
    slicer: Slicer | None = None,
    device: torch.device | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[torch.Tensor]:
    """Replay ``session``'s tape once and return the values of ``targets``, in order.

    A sliced target that `plan_blocks` accepts is generated as its block only, its random fills
    drawn through a buffer of ``chunk_bytes``; ``chunk_bytes=0`` replays every tensor whole.
    """
    if session.recording:
        raise DeferredInitError("materialize after leaving the no_init_parameters block")
    check_unchanged(session, targets)
    plan = plan_blocks(session, targets, slicer if chunk_bytes > 0 else None)
    wanted: dict[int, list[int]] = {}
    for position, target in enumerate(targets):
        wanted.setdefault(target.ref.key, []).append(position)
    values: list[torch.Tensor | None] = [None] * len(targets)
    schedule = _free_schedule(session.tape)
    real: dict[int, torch.Tensor] = {}
    with torch.no_grad(), _rng_scope(session):
        for index, entry in enumerate(session.tape):
            if isinstance(entry, RngReset):
                _rng.set_state(entry.device, entry.state)
                continue
            if index in plan.steps:
                _run_block(index, plan, real, session, chunk_bytes)
            else:
                _run(entry, real)
            for key in schedule.get(index, ()):
                root = real.pop(key)
                for n, position in enumerate(wanted.get(key, ())):
                    if key in plan.boxes:  # already the block
                        block = root if n == 0 else root.clone()
                        values[position] = block if device is None else block.to(device)
                    else:
                        values[position] = _extract(root, targets[position], slicer, device)
                del root  # else it stays alive while the next entry allocates its root
    missing = [targets[i].name for i, value in enumerate(values) if value is None]
    if missing:
        raise DeferredInitError(f"no recorded value for {', '.join(missing)}")
    return [value for value in values if value is not None]


def _run_block(
    index: int, plan: BlockPlan, real: dict[int, torch.Tensor], session: Session, chunk: int
) -> None:
    """Run the lowered entry ``index`` on its root's block (``real`` holds blocks for them)."""
    key, steps = plan.steps[index]
    real[key] = run_steps(
        steps,
        real,
        real.get(key),
        plan.boxes[key],
        plan.dtypes[key],
        session.root_device[key],
        chunk,
    )
