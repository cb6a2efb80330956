"""Checks of the dataset API's arguments, each raising the error that names the call, the
argument and what to pass: `as_int`, `check_int`, `check_workers`, `check_flag`,
`check_positive`, `check_ops` (a map's operations). Integers may be NumPy's (``np.int64(2)``,
as argparse-free scripts and ``np.arange`` give them); a bool is not an integer here."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from typing import Any


def as_int(value: object) -> int | None:
    """`value` as a Python int when it is an integer (NumPy's too) other than a bool, else
    None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def check_int(value: object, who: str, name: str, least: int) -> int:
    """`value` as a Python int >= `least`, else ValueError naming `who` and `name`."""
    number = as_int(value)
    if number is None or number < least:
        raise ValueError(f"{who}: {name}={value!r} must be an int >= {least}")
    return number


def check_workers(value: object, who: str) -> int:
    """`value` as a worker-process count (an int >= 0; None, MindSpore's default: 0, reading
    in this process), else ValueError naming `who`."""
    return 0 if value is None else check_int(value, who, "num_parallel_workers", 0)


def check_flag(value: object, who: str, name: str) -> bool:
    """`value` when it is a bool (numpy's too), else TypeError naming `who` and `name` (a
    string such as ``"False"`` would be true, silently)."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{who}: {name}={value!r} must be True or False")
    return bool(value)


def check_positive(value: object, who: str, name: str) -> int:
    """`value` as an int >= 1, else ValueError naming `who` and `name`."""
    return check_int(value, who, name, 1)


def check_ops(operations: object) -> tuple[Callable[..., Any], ...]:
    """`map`'s operations as a tuple of callables (one given alone, or a list)."""
    ops = tuple(operations) if isinstance(operations, list | tuple) else (operations,)
    if not ops:
        raise ValueError("map: operations is empty; pass a transform or a list of transforms")
    for op in ops:
        if not callable(op):
            raise TypeError(f"map: {op!r} is not callable; pass transforms or functions")
    return ops
