"""Checks of the dataset API's arguments, each raising the error that names the call, the
argument and what to pass: `check_workers`, `check_flag`, `check_positive`."""

from __future__ import annotations


def check_workers(value: object, who: str) -> int:
    """`value` as a worker-process count (an int >= 0), else ValueError naming `who`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{who}: num_parallel_workers={value!r} must be an int >= 0")
    return value


def check_flag(value: object, who: str, name: str) -> bool:
    """`value` when it is a bool (numpy's too), else TypeError naming `who` and `name` (a
    string such as ``"False"`` would be true, silently)."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{who}: {name}={value!r} must be True or False")
    return bool(value)


def check_positive(value: object, who: str, name: str) -> int:
    """`value` as an int >= 1, else ValueError naming `who` and `name`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{who}: {name}={value!r} must be an int >= 1")
    return value
