"""Capture leaves no fake tensor in the user's objects.

The capture runs the network or train step on fake tensors (no values). State the step creates
lazily on its first call would keep them for every later call: a ``torch.amp.GradScaler``'s
scale (``scaler.scale(loss)`` creates it), a mask or cache a module stores on itself, a buffer
registered in ``forward``. `kept_real` snapshots each object's attributes (and a module's
buffers) before the capture and, after it, puts back each value a fake tensor replaced and
removes each one added holding one, so the first real call creates them anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from shardwise._torch import pytree
from shardwise._torch.fake import FakeTensor
from shardwise._torch.module_state import own_buffers


def _fake(value: Any) -> bool:
    """Whether `value` is a fake tensor or a list / tuple / dict holding one."""
    if isinstance(value, FakeTensor):
        return True
    if isinstance(value, list | tuple | dict):
        return any(isinstance(leaf, FakeTensor) for leaf in pytree.tree_leaves(value))
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
    """Undo, on leaving, every fake tensor the block left in `objects`' attributes (see the
    module docstring).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> with kept_real([scaler]), FakeTensorMode():
        ...     scaler.scale(torch.ones(()))   # creates scaler._scale: a fake tensor
        >>> scaler._scale is None
        True
    """
    snapshots = []
    for obj in {id(o): o for o in objects}.values():
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        buffers = own_buffers(obj) if isinstance(obj, nn.Module) else None
        snapshots.append((attrs, dict(attrs), buffers, dict(buffers or {})))
    try:
        yield
    finally:
        for attrs, before, buffers, buffers_before in snapshots:
            _restore(attrs, before)
            if buffers is not None:
                _restore(buffers, buffers_before)
