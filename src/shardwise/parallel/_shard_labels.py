"""How `sw.shard`'s messages name what it wraps and each strategy entry.

An entry of a wrapped function's (or module's) ``in_strategy`` becomes a ``sw.reshard`` node of
the graph; its errors (a split that does not divide a dim, a layout of the wrong rank) come at
plan time. They name the call as the user wrote it, ``sw.shard(scaled_dot_product_attention)``,
and the entry, ``in_strategy entry 1 (key)``, rather than a ``sw.reshard`` the user never called
and ``input 0`` for every entry.

- `ShardLabels`: the wrapped callable's name and (found once, lazily) its argument names, in
  the order its signature lists them: from its signature, or for a builtin from the first
  line of its docstring (``scaled_dot_product_attention(query, key, value, ...)``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn


def _name(target: Callable[..., Any] | nn.Module) -> str:
    if isinstance(target, nn.Module):
        return type(target).__name__
    return str(getattr(target, "__name__", None) or type(target).__name__)


def _argument_names(target: Callable[..., Any] | nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of the positional arguments of `target` (of its ``forward`` for a module) and
    of all its named arguments (keyword-only ones too), each in the signature's order; empty
    when neither its signature nor its docstring tells them."""
    fn = target.forward if isinstance(target, nn.Module) else target
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin: `F.scaled_dot_product_attention`)
        names = _doc_names(fn)
        return names, names
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = (*kinds, inspect.Parameter.KEYWORD_ONLY)
    return (
        tuple(p.name for p in params if p.kind in kinds),
        tuple(p.name for p in params if p.kind in named),
    )


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
        self._names: tuple[tuple[str, ...], ...] | None = None

    def _found(self) -> tuple[tuple[str, ...], ...]:
        if self._names is None:
            self._names = _argument_names(self._target)
        return self._names

    def argument(self, key: int | str) -> str:
        """The name of the call's argument `key`: a position (``argument 3``: unknown) or the
        keyword it was passed by."""
        if isinstance(key, str):
            return key
        names = self._found()[0]
        return names[key] if key < len(names) else f"argument {key}"

    def keyword_order(self, keywords: Sequence[str]) -> list[str]:
        """`keywords` (arguments passed by keyword) in the order the signature lists them;
        those it does not list (taken by a ``**kwargs``) after them, in the order given."""
        named = self._found()[1]
        listed = [n for n in named if n in keywords]
        return listed + [k for k in keywords if k not in listed]

    def entry(self, what: str, index: int, key: int | str | None = None) -> str:
        """``in_strategy entry 1 (key)``: entry `index` of `what`, for the argument `key` of
        the call (a position or a keyword; None: an output)."""
        if key is None:
            return f"{what} entry {index}"
        return f"{what} entry {index} ({self.argument(key)})"
