"""Which tensors a replay generates block-wise, and running their steps on the block.

A target whose slicer index is a box (``TensorLayout.local_slice``: one step-1 slice per
dimension) and that is its root's whole, contiguous layout, on the CPU, is generated as that
box only when every tape entry touching its root lowers to steps (``_lower``) that touch
nothing else, and each random fill's chunked form is proven on this build
(``_chunked.proven``). Its state during the replay is then the box's own tensor; random fills
draw the whole tensor through a buffer of about ``chunk_bytes``. Every other tensor is replayed
whole, as before, and the reason is logged (logger ``shardwise.parameter``, level INFO).

- `BlockPlan`: the boxes, the lowered steps by tape position, and the reasons for whole ones.
- `plan_blocks`: build it for one replay.
- `run_steps`: apply one entry's steps to a block's state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.parameter._box import Box, box_of_index, contiguous_strides
from shardwise.parameter._chunked import ALIGN, Draw, TruncNormal, proven
from shardwise.parameter._errors import DeferredInitError
from shardwise.parameter._lower import (
    Create,
    Derive,
    Pointwise,
    Step,
    Unsupported,
    derivation,
    lower,
    refs_of,
)
from shardwise.parameter._tape import RecordedOp, Session, TensorRef

LOGGER = logging.getLogger("shardwise.parameter")

DEFAULT_CHUNK_BYTES = 4 << 20
"""The buffer a random fill draws through: 4 MiB (about a million float32 elements)."""

Slicer = Callable[[str, tuple[int, ...]], Any]
"""``slicer(name, full_shape) -> index`` (anything ``tensor[index]`` accepts) or None = whole."""


@dataclass
class BlockPlan:
    """Roots generated block-wise: their box, their steps by tape position; and why the other
    sliced targets are generated whole."""

    boxes: dict[int, Box] = field(default_factory=dict)
    dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    steps: dict[int, tuple[int, list[Step]]] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


def _roots(session: Session) -> dict[int, TensorRef]:
    """Each root's layout as created."""
    created: dict[int, TensorRef] = {}
    for entry in session.tape:
        if isinstance(entry, RecordedOp):
            for _, ref in entry.outputs:
                created[ref.key] = ref
    return created


def _box(target: Any, slicer: Slicer) -> Box | str | None:
    """The target's box; None if it is kept whole; a reason if its index is no box."""
    index = slicer(target.name, target.ref.size)
    if index is None:
        return None
    box = box_of_index(index, target.ref.size)
    if box is None:
        return "its index is not one step-1 slice per dimension"
    return None if box.is_whole else box


def _candidates(
    session: Session, targets: list[Any], slicer: Slicer, created: dict[int, TensorRef]
) -> tuple[dict[int, Box], dict[int, str], dict[str, str]]:
    """Roots whose targets all want the same box, with their reporting name; the reasons of
    the sliced targets that are not candidates."""
    boxes: dict[int, Box | str | None] = {}
    names: dict[int, str] = {}
    whole: dict[str, str] = {}
    for target in targets:
        ref: TensorRef = target.ref
        key, box = ref.key, _box(target, slicer)
        if isinstance(box, Box):
            if session.root_device.get(key, torch.device("meta")).type != "cpu":
                box = f"it is made on {session.root_device.get(key)} (chunks are proven on CPU)"
            elif created.get(key) != ref or ref.stride != contiguous_strides(ref.size):
                box = "it is a view of a larger or non-contiguous tensor"
        if key in boxes and boxes[key] != box:
            box = f"it shares its storage with {names[key]}, sliced differently"
            if isinstance(boxes[key], Box):
                whole[names[key]] = f"it shares its storage with {target.name}, sliced differently"
        if isinstance(box, str):
            whole[target.name] = box
        boxes[key], names[key] = box, names.get(key, target.name)
    kept = {key: box for key, box in boxes.items() if isinstance(box, Box)}
    return kept, names, whole


def _proven(steps: list[Step], dtype: torch.dtype) -> None:
    for step in steps:
        kind = step.kind if isinstance(step, Draw) else "trunc_normal"
        if isinstance(step, Draw | TruncNormal) and not proven(kind, dtype):
            raise Unsupported(f"chunked {kind} is not proven identical for {dtype} here")


def _sources(session: Session, created: dict[int, TensorRef]) -> dict[int, tuple[int, int]]:
    """Root -> (the one root it is computed from, the tape position), where that is the
    source's last use and its whole layout (so the source can live as the same block)."""
    last: dict[int, int] = {}
    for index, entry in enumerate(session.tape):
        if isinstance(entry, RecordedOp):
            for ref in _entry_refs(entry):
                last[ref.key] = index
    found: dict[int, tuple[int, int]] = {}
    for index, entry in enumerate(session.tape):
        if not isinstance(entry, RecordedOp) or len(entry.outputs) != 1:
            continue
        made, inputs = entry.outputs[0][1], refs_of((entry.args, entry.kwargs))
        if len(inputs) == 1 and inputs[0].key != made.key:
            source = inputs[0]
            cpu = session.root_device.get(source.key, torch.device("meta")).type == "cpu"
            if cpu and created[source.key] == source and last[source.key] == index:
                found[made.key] = (source.key, index)
    return found


@dataclass
class _Groups:
    """Candidate roots by the target root whose box they share (a target and the roots it is
    computed from); a failure drops the whole group."""

    boxes: dict[int, Box]
    names: dict[int, str]
    leader: dict[int, int] = field(default_factory=dict)
    derived: dict[int, int] = field(default_factory=dict)  # tape position -> made root

    def grow(self, sources: dict[int, tuple[int, int]], taken: set[int]) -> None:
        self.leader = {key: key for key in self.boxes}
        work = list(self.boxes)
        while work:
            made = work.pop()
            source, index = sources.get(made, (-1, -1))
            if source >= 0 and source not in taken and source not in self.boxes:
                self.boxes[source], self.leader[source] = self.boxes[made], self.leader[made]
                self.derived[index] = made
                work.append(source)

    def drop(self, key: int, why: str, whole: dict[str, str]) -> None:
        leader = self.leader[key]
        whole[self.names[leader]] = why if key == leader else f"it is computed from a tensor: {why}"
        for member in [k for k, v in self.leader.items() if v == leader]:
            self.boxes.pop(member, None)


def _lower_entry(
    entry: RecordedOp, index: int, key: int, groups: _Groups, created: dict[int, TensorRef]
) -> tuple[int, list[Step]] | None:
    """The steps of ``entry`` for candidate ``key`` (None: the made root's entry does it)."""
    keys = {ref.key for ref in _entry_refs(entry)}
    made = groups.derived.get(index)
    if made is not None:
        if key != made:
            return None
        source = refs_of((entry.args, entry.kwargs))[0]
        return made, [derivation(entry, source, created[made])]
    if len(keys) > 1:
        name = getattr(entry.func, "__name__", entry.func)
        how = "computes it from" if any(r.key == key for _, r in entry.outputs) else "uses it with"
        raise Unsupported(f"{name} {how} another tensor")
    lowered = lower(entry, created[key])
    _proven(lowered, created[key].dtype)
    return key, lowered


def plan_blocks(session: Session, targets: list[Any], slicer: Slicer | None) -> BlockPlan:
    """Decide which targets are generated as their block (see the module docstring)."""
    plan = BlockPlan()
    if slicer is None:
        return plan
    created = _roots(session)
    boxes, names, plan.whole = _candidates(session, targets, slicer, created)
    groups = _Groups(boxes, names)
    groups.grow(_sources(session, created), {target.ref.key for target in targets})
    steps: dict[int, tuple[int, list[Step]]] = {}
    for index, entry in enumerate(session.tape):
        if not isinstance(entry, RecordedOp):
            continue
        for key in {ref.key for ref in _entry_refs(entry)} & groups.boxes.keys():
            try:
                lowered = _lower_entry(entry, index, key, groups, created)
            except Unsupported as error:
                groups.drop(key, str(error), plan.whole)
                continue
            if lowered is not None:
                steps[index] = lowered
    plan.boxes = groups.boxes
    plan.dtypes = {key: created[key].dtype for key in plan.boxes}
    plan.steps = {i: (key, s) for i, (key, s) in steps.items() if key in plan.boxes}
    for name, why in plan.whole.items():
        LOGGER.info("%s is generated whole, then cut: %s", name, why)
    return plan


def _entry_refs(entry: RecordedOp) -> list[TensorRef]:
    return [*refs_of((entry.args, entry.kwargs)), *(ref for _, ref in entry.outputs)]


def chunk_elements(chunk_bytes: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a buffer of ``chunk_bytes`` (at least `ALIGN`)."""
    return max(ALIGN, chunk_bytes // dtype.itemsize)


def run_steps(
    steps: list[Step],
    real: dict[int, torch.Tensor],
    state: torch.Tensor | None,
    box: Box,
    dtype: torch.dtype,
    device: torch.device,
    chunk_bytes: int,
) -> torch.Tensor:
    """Apply ``steps`` to ``state`` (the box's tensor; None before `Create` or `Derive`, which
    reads its source's block from ``real``); returns it."""
    for step in steps:
        if isinstance(step, Derive):
            state = step.apply(real[step.source])
            continue
        if isinstance(step, Create):
            state = torch.empty(box.local_shape, dtype=dtype, device=device)
            if step.value is not None:
                state.fill_(step.value)
            continue
        if state is None:
            raise DeferredInitError("a block step ran before its tensor was created")
        if isinstance(step, Pointwise):
            region = box.intersect(step.box)
            if not region.is_empty:
                getattr(state[box.local_index(region)], step.name)(*step.args, **step.kwargs)
        else:
            step.run(state, box, chunk_elements(chunk_bytes, state.dtype))
    if state is None:
        raise DeferredInitError("no block step created the tensor")
    return state
