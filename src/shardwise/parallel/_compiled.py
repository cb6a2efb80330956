"""``torch.compile`` of an `AutoParallel` wrapper: the wrapper's call runs uncompiled.

Shardwise captures a wrapped network's (or train step's) ops and runs them one by one under
its plan, so dynamo must not trace the wrapper's own call. `uncompiled` marks that call
``torch.compiler.disable``'d: a compiled wrapper breaks its graph there and runs shardwise's
call as the uncompiled wrapper does. `warn_compiled` (called while dynamo traces the wrapper)
tells the user once per wrapper that compiling it has no effect.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])

_NO_EFFECT = (
    "torch.compile of an AutoParallel wrapper has no effect: the wrapper runs uncompiled "
    "(shardwise runs the network's or train step's ops one by one under its plan, and "
    "torch.compile'd code inside a wrapped call runs eagerly too; docs/parallel.md); call the "
    "wrapper uncompiled, sw.AutoParallel(net)(x)"
)

_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def uncompiled(fn: F) -> F:
    """``fn`` with dynamo disabled: a compiled caller runs it uncompiled (a graph break;
    under ``fullgraph=True`` dynamo's error carries `_NO_EFFECT`)."""
    return cast(F, torch.compiler.disable(fn, reason=_NO_EFFECT))


@uncompiled
def warn_compiled(wrapper: Any) -> None:
    """Warn once per wrapper that ``torch.compile`` of it has no effect."""
    if wrapper in _warned:
        return
    _warned.add(wrapper)
    warnings.warn(_NO_EFFECT + ".", UserWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The warning's stacklevel from `warn_compiled`: the first frame outside torch and
    shardwise (the user's call of the compiled wrapper)."""
    frame = sys._getframe(2)  # (`warn_compiled`'s caller: level 2)
    level = 2
    while frame.f_back is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    return level


def _internal(frame: Any) -> bool:
    return str(frame.f_globals.get("__name__", "")).split(".")[0] in ("torch", "shardwise")
