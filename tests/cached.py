"""`outside_worlds`: ``functools.cache`` for tests' data and single-device references, refusing
a call made inside a simulated world.

Inside ``simulated_world(n)`` every factory makes per-rank tensors. A cached helper whose first
call came from inside a world would hand those to every later test on the same pytest-xdist
worker (which test calls it first depends on how xdist spreads the tests: such a test failed
only in some runs). Every call, first or not, is therefore refused inside a world.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_worlds(fn: F) -> F:
    """`fn` cached as ``functools.cache`` does; a call inside a simulated world raises."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if type(torch.empty(0)) is not torch.Tensor:  # (a factory inside a world: per-rank)
            raise AssertionError(
                f"{fn.__qualname__}() called inside a simulated world: call it before "
                "`with simulated_world(...)` (its cached tensors would hold per-rank values)"
            )
        return cached(*args, **kwargs)

    return call  # type: ignore[return-value]
