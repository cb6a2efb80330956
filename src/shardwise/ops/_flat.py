"""Flattening an aten call's arguments on the planners' hot path (used by `_dtensor`,
`aten_rules`, ``planner/_follow.py`` and the capture's ``planner/_recorders.py``).

The planners walk every aten call of every node, for every candidate layout, and each walk
flattens the call's arguments several times: to find its tensor arguments, to put their
layouts in, to make a memo key. The arguments as the capture recorded them are nested tuples,
lists and dicts of plain values, so these functions handle exactly those containers (and
``torch.Size``, flattened as torch's pytree flattens it), in pytree's order; torch's general
pytree, which first looks up each object's registered node type, costs several times more.

- `leaves`: the leaves, in pytree order.
- `map_only`: the same structure with each instance of a class replaced by a function's result.
- `key`: a hashable form of the structure, with each instance of a class given by a function
  (None when a leaf cannot be hashed or a container is not a plain one).
- `plain`: whether a tree (a torch call's arguments, as a user's network passes them) holds no
  container but these, so that the functions above agree with torch's pytree on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shardwise._torch import pytree

L = TypeVar("L")
_TUPLE, _LIST, _DICT = object(), object(), object()  # (`key`'s container tags: no value equals one)


def leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples / lists / dicts (and ``torch.Size``), in pytree order.

    Example:
        >>> leaves(((1, [2, None]), {"k": 3}))
        [1, 2, None, 3]
    """
    out: list[Any] = []
    _into(tree, out)
    return out


def _into(tree: Any, out: list[Any]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list or kind is torch.Size:
        for x in tree:
            _into(x, out)
    elif kind is dict:
        for x in tree.values():
            _into(x, out)
    else:
        out.append(tree)


def map_only(cls: type[L], fn: Callable[[L], Any], tree: Any) -> Any:
    """`tree` with each instance of `cls` replaced by ``fn(instance)`` (the containers are
    rebuilt, a ``torch.Size`` as a tuple, as torch's pytree rebuilds it).

    Example:
        >>> map_only(int, lambda x: x * 10, ((1, "a"), {"k": [2]}))
        ((10, 'a'), {'k': [20]})
    """
    kind = type(tree)
    if kind is tuple or kind is torch.Size:
        return tuple(map_only(cls, fn, x) for x in tree)
    if kind is list:
        return [map_only(cls, fn, x) for x in tree]
    if kind is dict:
        return {k: map_only(cls, fn, v) for k, v in tree.items()}
    return fn(tree) if isinstance(tree, cls) else tree


def key(cls: type[L], fn: Callable[[L], Any], tree: Any) -> object | None:
    """A hashable form of `tree`: its structure (tuple, list and dict told apart, dict keys
    kept) with each instance of `cls` given as ``fn(instance)``; None when some leaf is not
    hashable or some container is not a plain one (`plain`).

    Example:
        >>> key(int, str, ([1], (2,))) == key(int, str, ((1,), [2]))
        False
    """
    try:
        made: object = _key(cls, fn, tree)
        hash(made)
    except TypeError:
        return None
    return made


def _key(cls: type[L], fn: Callable[[L], Any], tree: Any) -> Any:
    kind = type(tree)
    if kind is tuple or kind is list or kind is torch.Size:  # (a Size: a tuple, as pytree has it)
        return (_LIST if kind is list else _TUPLE, *(_key(cls, fn, x) for x in tree))
    if kind is dict:
        return (_DICT, *((k, _key(cls, fn, v)) for k, v in tree.items()))
    if _foreign(tree):
        raise TypeError(f"not a plain container: {kind.__name__}")  # (`key` answers None)
    return fn(tree) if isinstance(tree, cls) else tree


def plain(tree: Any) -> bool:
    """Whether `tree` holds no container but exact tuples, lists and dicts (and
    ``torch.Size``): no namedtuple, ``OrderedDict`` or type registered with torch's pytree,
    which `leaves` and `map_only` would take for leaves.

    Example:
        >>> plain(((1, [2]), {"k": 3})), plain((torch.return_types.max((1, 2)),))
        (True, False)
    """
    kind = type(tree)
    if kind is tuple or kind is list:
        return all(plain(x) for x in tree)
    if kind is dict:
        return all(plain(x) for x in tree.values())
    return kind is torch.Size or not _foreign(tree)


def _foreign(tree: Any) -> bool:
    """Whether `tree` (no exact tuple, list, dict or ``torch.Size``) is still a container to
    torch's pytree: a subclass of those (a namedtuple, an ``OrderedDict``) or a registered
    type."""
    return isinstance(tree, tuple | list | dict) or type(tree) in pytree.SUPPORTED_NODES
