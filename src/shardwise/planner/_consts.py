"""The constants of a capture (tensors the networks do not hold: a frozen teacher's weights, a
class-weight tensor) as one value each (`one_values`)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise._torch import pytree
from shardwise.communication import rank_parts

T = torch.Tensor


def one_values(
    args: tuple[Any, ...], kw: dict[str, Any], consts: list[T]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with each constant (a tensor the networks do not hold: a frozen
    teacher's weight) as its value on this process's first rank (`comm.rank_parts`): a process
    that runs several ranks records it as one value, as a job's process does."""
    swap = {id(t): one for t in consts if (one := rank_parts(t)[0]) is not t}
    if not swap:
        return args, kw
    out = pytree.tree_map_only(T, lambda t: swap.get(id(t), t), (args, kw))
    return out[0], out[1]
