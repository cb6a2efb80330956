"""Durations read from ``SHARDWISE_*`` environment variables: `env_seconds` parses one and
refuses a value that is not a number of seconds in range (at most `MAX_SECONDS`, which every
wait they bound accepts), with a message naming the variable, its value, what it must be and
its default (the launcher checks its variables up front, `launch.cli`, so a bad value is a
usage error before anything starts). `comm_timeout_s` reads ``SHARDWISE_COMM_TIMEOUT``, which
the workers' waits (`communication._store_sync.comm_timeout`) and the launcher read alike."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

COMM_TIMEOUT_S = 300.0
"""``SHARDWISE_COMM_TIMEOUT``'s default: how long any wait of shardwise's communication lasts."""
MAX_SECONDS = (2**31 - 1) / 1000
"""The most seconds a duration may be: 2**31 - 1 milliseconds (about 24.8 days), well inside
what the waits they bound take (``datetime.timedelta``, torch's timeouts in milliseconds,
``threading`` waits); 1e15 s overflowed the timedelta in every worker."""


def env_seconds(
    name: str,
    default: float,
    *,
    allow_zero: bool = False,
    minimum: float = 0.0,
    maximum: float = MAX_SECONDS,
    env: Mapping[str, str] | None = None,
) -> float:
    """The seconds in environment variable `name`, or `default` when it is unset or empty.

    Args:
        name: the variable, e.g. ``SHARDWISE_COMM_TIMEOUT``.
        default: the value when it is unset (or set to an empty string).
        allow_zero: whether 0 is allowed (otherwise the value must be more than 0).
        minimum: when more than 0, the least value allowed.
        maximum: the most allowed (default `MAX_SECONDS`).
        env: the environment (``os.environ`` when None).

    Raises:
        ValueError: not a finite number, negative, 0 without `allow_zero`, below `minimum`
            or above `maximum`; the message names the variable, its value, the range and its
            default.

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
    bound += f" and at most {maximum:.10g}"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low = value < max(0.0, minimum) or (value == 0 and not allow_zero)
    if not math.isfinite(value) or low or value > maximum:
        raise ValueError(
            f"environment variable {name}={text!r}: expected a number of seconds, {bound} "
            f"(fractions allowed); set it to such a number, or unset it for the default "
            f"{default:g} s"
        )
    return value


def comm_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """``$SHARDWISE_COMM_TIMEOUT`` seconds, default `COMM_TIMEOUT_S` (more than 0).

    Raises:
        ValueError: the variable is not such a number of seconds (`env_seconds`).

    Example:
        >>> comm_timeout_s({"SHARDWISE_COMM_TIMEOUT": "30"})
        30.0
    """
    return env_seconds("SHARDWISE_COMM_TIMEOUT", COMM_TIMEOUT_S, env=env)
