"""Global optimizer step hooks (and ``zero_grad`` hooks) that go away with their owner, removed
at a safe point.

torch keeps global optimizer step hooks in module-level dicts that every ``Optimizer.step``
iterates. The wrappers' hooks hold their owner weakly and are removed by its finalizer; but
garbage collection runs at any allocation, also inside another hook while a step iterates
those dicts, and removing an entry then fails that step (``RuntimeError: OrderedDict mutated
during iteration``, in whichever optimizer happened to step).

- `remove_later`: what a finalizer calls: the handles are queued, not removed (their hooks do
  nothing once the owner is gone).
- `register_pre` / `register_post`: register a global pre / post hook, first removing the
  queued ones (registration never runs inside a step's iteration of the hooks).
- `register_zero_grad`: a hook run before every ``zero_grad`` of an optimizer or a module
  (torch has no such hook: ``torch.optim.Optimizer.zero_grad`` and ``torch.nn.Module.zero_grad``
  are wrapped, once, at the first registration); removed like the others.
- `track_closures` / `stepping` / `after_closure`: while a `track_closures` handle is held,
  one global pre hook (shared by every holder, registered at the first) hands each step that
  has a closure one that notes its optimizer while it runs and, when it returns, calls the
  `after_closure` hooks with that optimizer; `stepping` lists the optimizers whose closure
  runs now (outermost first). A network first called inside a closure (the module form: the
  wrapper's first call inside ``opt.step(closure)``) finds the optimizer that is stepping,
  whose pre hooks ran before the network's were there; gradients a closure's backward made
  after the step's pre hooks are seen before the update (`after_closure`). Once no handle is
  held the pre hook hands closures on unchanged, and it is removed at the next registration.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

_queued: list[RemovableHandle] = []
# (an OrderedDict: a `RemovableHandle` holds its dict by weak reference)
_zero_grad_hooks: OrderedDict[int, Callable[[Any, bool], None]] = OrderedDict()
_wrapped: set[type] = set()  # (the classes whose ``zero_grad`` calls the hooks first)
_stepping: list[torch.optim.Optimizer] = []  # (whose closure runs now: `stepping`)
# (the `track_closures` holders; the one pre hook they share while any is held)
_trackers: OrderedDict[int, None] = OrderedDict()
_tracking: list[RemovableHandle] = []
_closure_ends: OrderedDict[int, Callable[[torch.optim.Optimizer], None]] = OrderedDict()


def remove_later(handles: Iterable[RemovableHandle]) -> None:
    """Queue `handles` for removal at the next registration (see the module docstring)."""
    _queued.extend(handles)


def _drop_queued() -> None:
    while _queued:
        _queued.pop().remove()
    if not _trackers:  # (no holder left: the shared closure hook goes too)
        while _tracking:
            _tracking.pop().remove()


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


def register_zero_grad(hook: Callable[[Any, bool], None]) -> RemovableHandle:
    """Call ``hook(owner, set_to_none)`` before every ``zero_grad(set_to_none)`` of an optimizer
    or a module (`owner`), after removing the queued handles. A subclass's own ``zero_grad``
    that does not call torch's is not seen.

    Example:
        >>> handle = register_zero_grad(lambda owner, set_to_none: None)
        >>> remove_later([handle])
    """
    _drop_queued()
    for cls in (torch.optim.Optimizer, torch.nn.Module):
        if cls not in _wrapped:
            cls.zero_grad = _calling_hooks(cls.zero_grad)  # type: ignore[method-assign]
            _wrapped.add(cls)
    handle = RemovableHandle(_zero_grad_hooks)
    _zero_grad_hooks[handle.id] = hook
    return handle


def _calling_hooks(zero_grad: Callable[..., None]) -> Callable[..., None]:
    """torch's `zero_grad`, the registered hooks called first."""

    @functools.wraps(zero_grad)
    def wrapped(self: Any, set_to_none: bool = True) -> None:
        for hook in list(_zero_grad_hooks.values()):  # (a copy: a hook may drop one)
            hook(self, set_to_none)
        zero_grad(self, set_to_none)

    return wrapped


def track_closures() -> RemovableHandle:
    """Hold the global pre hook noting each optimizer while its step's closure runs
    (`stepping`) and calling the `after_closure` hooks when it returns, after removing the
    queued handles: registered at the first holder, shared by the others. Removing the
    returned handle (at any time, also from a finalizer inside a step) releases it: with no
    holder left closures are handed on unchanged, and the hook is removed at the next
    registration.

    Example:
        >>> handle = track_closures()
        >>> stepping()
        []
        >>> handle.remove()
    """
    _drop_queued()
    if not _tracking:
        _tracking.append(register_optimizer_step_pre_hook(_noting_closure))
    handle = RemovableHandle(_trackers)
    _trackers[handle.id] = None
    return handle


def after_closure(hook: Callable[[torch.optim.Optimizer], None]) -> RemovableHandle:
    """Call ``hook(optimizer)`` each time a step's closure returns (while a `track_closures`
    handle is held), before the optimizer goes on with the gradients it made; removed like
    the other hooks (`remove_later`).

    Example:
        >>> handle = after_closure(lambda optimizer: None)
        >>> remove_later([handle])
    """
    _drop_queued()
    handle = RemovableHandle(_closure_ends)
    _closure_ends[handle.id] = hook
    return handle


def stepping() -> list[torch.optim.Optimizer]:
    """The optimizers whose step's closure runs now (outermost first), seen while a
    `track_closures` handle is held."""
    return list(dict.fromkeys(_stepping))


def _noting_closure(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The step's arguments with its closure (positional after the optimizer, or ``closure=``)
    replaced by one noting `optimizer` while it runs; None (unchanged) without a closure or
    without a `track_closures` holder."""
    if not _trackers:
        return None
    return replace_closure(args, kwargs, lambda closure: _noted(optimizer, closure))


def replace_closure(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A step pre-hook's result handing the step ``wrap(closure)`` for its closure (positional
    after the optimizer, or ``closure=``); None (the arguments unchanged) without one.

    Example:
        >>> replace_closure((opt, closure), {}, lambda c: c)   # doctest: +SKIP
        ((opt, closure), {})
    """
    if len(args) > 1 and callable(args[1]):
        return (args[0], wrap(args[1]), *args[2:]), kwargs
    closure = kwargs.get("closure")
    if callable(closure):
        return args, {**kwargs, "closure": wrap(closure)}
    return None


def _noted(optimizer: torch.optim.Optimizer, closure: Callable[..., Any]) -> Callable[..., Any]:
    """`closure`, `optimizer` listed in `stepping` while it runs, the `after_closure` hooks
    called with it when it returns."""

    @functools.wraps(closure)
    def noted(*args: Any, **kwargs: Any) -> Any:
        _stepping.append(optimizer)
        try:
            out = closure(*args, **kwargs)
        finally:
            _stepping.pop()
        for hook in list(_closure_ends.values()):  # (a copy: a finalizer may drop one)
            hook(optimizer)
        return out

    return noted
