"""No AutoParallel call inside a planned one in a thread (`running`): a wrapper called inside
the call of a wrapper that captures and runs a plan (a teacher wrapped on its own, called in the
student's semi_auto train step) is refused with a ValueError naming both wrappers and the fix
(one network holding both). A data_parallel-mode wrapper runs its step as written: wrappers
called inside its call run as they would alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.parallel._auto import AutoParallel

_calls = threading.local()  # (`running`: the wrapper whose call runs in this thread)


@contextmanager
def running(wrapper: AutoParallel, planned: bool = True) -> Iterator[None]:
    """`wrapper`'s call (`planned`: it captures and runs a plan); a wrapper called inside a
    planned wrapper's call is a ValueError (the outer one captures, plans and runs every op its
    step calls: the inner wrapper's capture, planning and collectives included, which it
    cannot follow)."""
    outer = getattr(_calls, "wrapper", None)
    if outer is not None:
        raise ValueError(
            f"AutoParallel: the wrapper of {_who(wrapper)} was called inside the call of the "
            f"wrapper of {_who(outer)}; one AutoParallel cannot run inside another's step. "
            "Wrap one network holding both (a container module as network=, e.g. "
            "nn.ModuleDict(student=..., teacher=...)) and call the inner network itself in "
            "the step"
        )
    if not planned:
        yield
        return
    _calls.wrapper = wrapper
    try:
        yield
    finally:
        _calls.wrapper = None


def _who(wrapper: AutoParallel) -> str:
    step = wrapper.train_step
    count = sum(p.numel() for p in wrapper.network.parameters())
    name = f"{type(wrapper.network).__name__} ({count:,} parameter elements"
    return name + (")" if step is None else f", train step {getattr(step, '__name__', step)})")
