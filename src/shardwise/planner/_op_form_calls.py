"""Which captured call an op-form ``sw.shard`` annotation applies to.

The op form (``sw.shard(linear, in_strategy=...)``) gives the strategy to the one torch call
an ``nn.Linear`` / ``nn.Embedding`` makes in its ``forward``. While the module runs, its
hooks run too, inside its module path: forward pre-hooks (``torch.nn.utils.weight_norm``'s
recomputation of the weight among them) and the input wrapper of full backward hooks. Their
calls are not the module's op: they are planned as ordinary, unannotated ops.

- `Annotated`: one annotated module being run (its path, strategy, the module, the call that
  took the strategy).
- `annotation`: the strategy of a call about to be recorded (None: not the annotated op); a
  second call made by the module's ``forward`` is a `CaptureError` naming both calls.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any

from torch import nn

from shardwise.planner._source_lines import source_line


@dataclass
class Annotated:
    """An op-form annotated module being run: its `path`, `strategy` and `module`; `took`:
    the call that took the strategy and its line (None: none yet)."""

    path: str
    strategy: tuple[Any, ...]
    module: nn.Module
    took: str | None = None


def annotation(annotated: list[Annotated], stack: list[str], op: str) -> tuple[Any, ...] | None:
    """The op-form strategy for call `op` (None: it is not an annotated module's own call).

    A call made directly in the innermost running module (`stack`'s last path) while that
    module is annotated takes its strategy when its ``forward`` makes it; one made by the
    module's hooks stays unannotated.

    Raises:
        CaptureError: the module's ``forward`` makes a second call (it is not one op).
    """
    if not annotated or not stack or annotated[-1].path != stack[-1]:
        return None
    entry = annotated[-1]
    own = _made_by_forward(entry.module)
    if own is False:
        return None
    if entry.took is not None:
        from shardwise.planner._recorders import CaptureError

        unread = (
            f" (its forward, a {type(entry.module.forward).__name__}, cannot be read: the calls "
            f"of its hooks count as the forward's; register them on the parent module)"
            if own is None
            else ""
        )
        name = entry.path or f"the top-level {type(entry.module).__name__}"
        raise CaptureError(
            f"sw.shard on {name}: its op-form in_strategy annotates the single torch call "
            f"of the module's forward, {entry.took}, but the forward also called {op} at "
            f"{source_line()}{unread}; annotate a module that makes one call (nn.Linear, "
            f"nn.Embedding), or reshard its inputs instead"
        )
    entry.took = f"{op} at {source_line()}"
    return entry.strategy


def _made_by_forward(module: nn.Module) -> bool | None:
    """Whether the running call is made inside `module`'s ``forward`` (a frame of it, run on
    `module`, on the call stack), not by one of its hooks, which torch runs next to the
    forward. None when the forward's code cannot be read (a callable object as ``forward``):
    every call is then taken as its own."""
    codes = _forward_codes(module)
    if codes is None:
        return None
    methods, own = codes
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in own:
            return True
        on = code in methods and code.co_argcount and frame.f_locals.get(code.co_varnames[0])
        if on is module:  # (a method of the forward's run on `module`: its first argument)
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _forward_codes(module: nn.Module) -> tuple[set[CodeType], set[CodeType]] | None:
    """The code objects of `module`'s ``forward``: its class's and its bases' (a subclass
    calling ``super().forward``), and an instance's own ``forward`` with what it wraps (None:
    an instance's own ``forward`` without code, such as a ``functools.partial``)."""
    methods: set[CodeType] = set()
    for cls in type(module).__mro__:
        fn = cls.__dict__.get("forward")
        if fn is not None and cls is not nn.Module:
            methods |= _codes_of(fn)
    own = module.__dict__.get("forward")
    if own is None:
        return methods, set()
    return (methods, _codes_of(own)) if _codes_of(own) else None


def _codes_of(fn: Any) -> set[CodeType]:
    """The code of function `fn` and of those it wraps (``functools.wraps``)."""
    fn = getattr(fn, "__func__", fn)
    try:
        chain = [fn, inspect.unwrap(fn)]
    except ValueError:  # (a wrapper cycle)
        chain = [fn]
    codes = (getattr(getattr(f, "__func__", f), "__code__", None) for f in chain)
    return {c for c in codes if isinstance(c, CodeType)}
