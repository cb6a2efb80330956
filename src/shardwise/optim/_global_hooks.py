"""Global optimizer step hooks that go away with their owner, removed at a safe point.

torch keeps global optimizer step hooks in module-level dicts that every ``Optimizer.step``
iterates. The wrappers' hooks hold their owner weakly and are removed by its finalizer; but
garbage collection runs at any allocation, also inside another hook while a step iterates
those dicts, and removing an entry then fails that step (``RuntimeError: OrderedDict mutated
during iteration``, in whichever optimizer happened to step).

- `remove_later`: what a finalizer calls: the handles are queued, not removed (their hooks do
  nothing once the owner is gone).
- `register_pre` / `register_post`: register a global pre / post hook, first removing the
  queued ones (registration never runs inside a step's iteration of the hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

_queued: list[RemovableHandle] = []


def remove_later(handles: Iterable[RemovableHandle]) -> None:
    """Queue `handles` for removal at the next registration (see the module docstring)."""
    _queued.extend(handles)


def _drop_queued() -> None:
    while _queued:
        _queued.pop().remove()


def register_pre(hook: Callable[..., Any]) -> RemovableHandle:
    """``torch.optim.optimizer.register_optimizer_step_pre_hook``, after removing the queued.

    Example:
        >>> handle = register_pre(lambda optimizer, args, kwargs: None)
        >>> remove_later([handle])
    """
    _drop_queued()
    return register_optimizer_step_pre_hook(hook)


def register_post(hook: Callable[..., Any]) -> RemovableHandle:
    """``torch.optim.optimizer.register_optimizer_step_post_hook``, after removing the queued.

    Example:
        >>> handle = register_post(lambda optimizer, args, kwargs: None)
        >>> remove_later([handle])
    """
    _drop_queued()
    return register_optimizer_step_post_hook(hook)
