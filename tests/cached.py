"""`outside_worlds`: ``functools.cache`` for tests' data and single-device references, made
only outside a simulated world.

Inside ``simulated_world(n)`` every factory makes per-rank tensors. A cached helper whose first
call came from inside a world would hand those to every later test on the same pytest-xdist
worker (which test calls it first depends on how xdist spreads the tests: such a test failed
only in some runs). A call that would make the value inside a world is therefore refused; a
value made before (a test calling the helper before its world, then again inside) is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_worlds(fn: F) -> F:
    """`fn` cached as ``functools.cache`` does; a call that would make its value inside a
    simulated world raises."""
    made: dict[Hashable, Any] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in made:
            if type(torch.empty(0)) is not torch.Tensor:  # (a factory inside a world: per-rank)
                raise AssertionError(
                    f"{fn.__qualname__}{args} first called inside a simulated world: call it "
                    "before `with simulated_world(...)` (its cached tensors would hold "
                    "per-rank values)"
                )
            made[key] = fn(*args, **kwargs)
        return made[key]

    return call  # type: ignore[return-value]
