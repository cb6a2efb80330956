"""Durations read from ``SHARDWISE_*`` environment variables: `env_seconds` parses one and
refuses a value that is not a number of seconds in range, with a message naming the variable,
its value, what it must be and its default (the launcher checks its variables up front,
`launch.cli`, so a bad value is a usage error before anything starts)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping


def env_seconds(
    name: str,
    default: float,
    *,
    allow_zero: bool = False,
    minimum: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> float:
    """The seconds in environment variable `name`, or `default` when it is unset or empty.

    Args:
        name: the variable, e.g. ``SHARDWISE_COMM_TIMEOUT``.
        default: the value when it is unset (or set to an empty string).
        allow_zero: whether 0 is allowed (otherwise the value must be more than 0).
        minimum: when more than 0, the least value allowed.
        env: the environment (``os.environ`` when None).

    Raises:
        ValueError: not a finite number, negative, 0 without `allow_zero`, or below
            `minimum`; the message
            names the variable, its value and its default.

    Example:
        >>> env_seconds("SHARDWISE_NODE_TIMEOUT", 5.0, env={"SHARDWISE_NODE_TIMEOUT": "2.5"})
        2.5
        >>> env_seconds("SHARDWISE_NODE_TIMEOUT", 5.0, env={})
        5.0
    """
    text = (os.environ if env is None else env).get(name, "").strip()
    if not text:
        return default
    bound = f"{minimum:g} or more" if minimum > 0 else "0 or more" if allow_zero else "more than 0"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < max(0.0, minimum) or (value == 0 and not allow_zero):
        raise ValueError(
            f"environment variable {name}={text!r}: expected a number of seconds, {bound} "
            f"(fractions allowed); set it to such a number, or unset it for the default "
            f"{default:g} s"
        )
    return value
