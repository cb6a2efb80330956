"""Capture leaves no fake tensor in the user's objects.

The capture runs the network or train step on fake tensors (no values). State the step creates
lazily on its first call would keep them for every later call: a ``torch.amp.GradScaler``'s
scale (``scaler.scale(loss)`` creates it), a mask or cache a module stores on itself, a buffer
registered in ``forward``, a running metric (``stats["correct"] = stats["correct"] + ...``,
``global total``). `kept_real` snapshots each object's attributes (and a module's buffers),
each dict, list and closure cell before the capture and, after it, puts back each value a
fake tensor replaced and removes each one added holding one, so the first real call creates
them anew.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from shardwise._torch import pytree
from shardwise._torch.fake import holds_fake
from shardwise._torch.module_state import own_buffers


def _fake(value: Any) -> bool:
    """Whether `value` is a fake tensor or a list / tuple / dict holding one."""
    if holds_fake(value):
        return True
    if isinstance(value, list | tuple | dict):
        return any(holds_fake(leaf) for leaf in pytree.tree_leaves(value))
    return False


def _restore(store: dict[str, Any], before: dict[str, Any]) -> None:
    """In `store` (an object's ``__dict__``, a module's ``_buffers``): each value set or added
    holding a fake tensor back to what `before` had, or removed when it had none (a container
    that was there before is left: a module's own ``_buffers``, restored apart)."""
    for name, value in list(store.items()):
        if value is not before.get(name) and _fake(value):
            old = before.get(name)
            if name in before and not _fake(old):
                store[name] = old
            else:
                del store[name]


@contextmanager
def kept_real(objects: Iterable[Any]) -> Iterator[None]:
    """Undo, on leaving, every fake tensor the block left in `objects` (see the module
    docstring): in an object's attributes (a module's buffers too), a dict's values, a list's
    items, a closure cell's content.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> with kept_real([scaler]), FakeTensorMode():
        ...     scaler.scale(torch.ones(()))   # creates scaler._scale: a fake tensor
        >>> scaler._scale is None
        True
    """
    undo: list[Callable[[], None]] = []
    for obj in {id(o): o for o in objects}.values():
        if isinstance(obj, list):
            undo.append(functools.partial(_restore_list, obj, list(obj)))
        elif isinstance(obj, types.CellType):
            undo.append(functools.partial(_restore_cell, obj, _content(obj)))
        else:
            store = obj if isinstance(obj, dict) else getattr(obj, "__dict__", None)
            if isinstance(store, dict):
                undo.append(functools.partial(_restore, store, dict(store)))
            buffers = own_buffers(obj) if isinstance(obj, nn.Module) else None
            if buffers is not None:
                undo.append(functools.partial(_restore, buffers, dict(buffers)))
    try:
        yield
    finally:
        for step in undo:
            step()


def _restore_list(items: list[Any], before: list[Any]) -> None:
    """Each item of `items` holding a fake tensor back to `before`'s at its index, or dropped
    when that one held none either (a fake appended)."""
    if not any(_fake(v) for v in items):
        return
    kept = []
    for i, v in enumerate(items):
        if not _fake(v):
            kept.append(v)
        elif i < len(before) and not _fake(before[i]):
            kept.append(before[i])
    items[:] = kept


_EMPTY = object()


def _content(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _EMPTY


def _restore_cell(cell: types.CellType, before: Any) -> None:
    """A closure cell holding a fake tensor back to what it held (``nonlocal total``)."""
    if _fake(_content(cell)):
        if before is _EMPTY:
            del cell.cell_contents
        else:
            cell.cell_contents = before
