"""`FrozenMap`: the read-only mappings of a frozen `ParallelPlan`."""

from __future__ import annotations

from typing import Any


class FrozenMap(dict):  # type: ignore[type-arg]
    """A dict that cannot change once made: the mappings of a frozen `ParallelPlan` (a dict
    for everything else: equality, JSON, iteration, pickling)."""

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "a ParallelPlan is frozen: its mappings cannot change (dataclasses.replace(plan, "
            "field=...) makes a new plan)"
        )

    __setitem__ = __delitem__ = __ior__ = _frozen  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _frozen  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (dict(self),))
