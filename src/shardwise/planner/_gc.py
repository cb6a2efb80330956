"""Pausing CPython's cyclic garbage collector while a graph is captured and planned.

Capturing and planning a large graph allocates millions of small objects (fake tensors, nodes,
candidates, placements, cost tuples) that hold no reference cycles. CPython's generational
collector still walks the whole heap at each full collection, which such allocation rates
trigger several times per plan, each walk costing a noticeable part of the planning time
(bench/README.md, "Planning time"). `gc_paused` (on `capture`, `plan_semi_auto`, propagation
and the search) turns automatic collection off for the duration of a call and restores the
previous state afterwards; anything left unreachable is freed by reference counting or by the
next collection after it.

- `gc_paused`: a decorator doing that around a planner entry point (re-entrant).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` with automatic garbage collection off (restored after, also on error).

    Example:
        >>> @gc_paused
        ... def plan() -> int:
        ...     return 1
        >>> plan()
        1
    """

    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused
