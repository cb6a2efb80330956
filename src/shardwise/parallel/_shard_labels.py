"""How `sw.shard`'s messages name what it wraps and each strategy entry.

An entry of a wrapped function's (or module's) ``in_strategy`` becomes a ``sw.reshard`` node of
the graph; its errors (a split that does not divide a dim, a layout of the wrong rank) come at
plan time. They name the call as the user wrote it, ``sw.shard(scaled_dot_product_attention)``,
and the entry, ``in_strategy entry 1 (key)``, rather than a ``sw.reshard`` the user never called
and ``input 0`` for every entry.

- `ShardLabels`: the wrapped callable's name and (found once, lazily) its positional argument
  names: from its signature, or for a builtin from the first line of its docstring
  (``scaled_dot_product_attention(query, key, value, ...)``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import nn


def _name(target: Callable[..., Any] | nn.Module) -> str:
    if isinstance(target, nn.Module):
        return type(target).__name__
    return str(getattr(target, "__name__", None) or type(target).__name__)


def _argument_names(target: Callable[..., Any] | nn.Module) -> tuple[str, ...]:
    """The names of the positional arguments of `target` (of its ``forward`` for a module);
    empty when neither its signature nor its docstring tells them."""
    fn = target.forward if isinstance(target, nn.Module) else target
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin: `F.scaled_dot_product_attention`)
        return _doc_names(fn)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _doc_names(fn: Any) -> tuple[str, ...]:
    name, doc = getattr(fn, "__name__", ""), getattr(fn, "__doc__", None) or ""
    found = re.match(rf"\s*{re.escape(name)}\(([^)]*)\)", doc) if name else None
    if found is None:
        return ()
    out = []
    for part in found.group(1).split(","):
        arg = re.split(r"[=:]", part)[0].strip()
        if not arg.isidentifier():  # (``*``, ``/``: the positional ones end there)
            break
        out.append(arg)
    return tuple(out)


class ShardLabels:
    """The names `sw.shard`'s messages give the wrapped callable and its strategy entries."""

    def __init__(self, target: Callable[..., Any] | nn.Module) -> None:
        self.who = f"sw.shard({_name(target)})"
        self._target = target
        self._names: tuple[str, ...] | None = None

    def argument(self, position: int) -> str:
        """The name of the call's positional argument `position` (``argument 3``: unknown)."""
        if self._names is None:
            self._names = _argument_names(self._target)
        names = self._names
        return names[position] if position < len(names) else f"argument {position}"

    def entry(self, what: str, index: int, position: int | None = None) -> str:
        """``in_strategy entry 1 (key)``: entry `index` of `what`, for the argument at
        `position` of the call (None: an output)."""
        if position is None:
            return f"{what} entry {index}"
        return f"{what} entry {index} ({self.argument(position)})"
