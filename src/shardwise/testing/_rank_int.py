"""The rank a simulated world's ``get_rank()`` returns: an int with each rank's value, which a
Python ``if`` cannot branch on.

One process runs every rank of `simulated_world(n)`, so ``get_rank()`` is a per-rank
symbolic int (torch's ``LocalIntNode``). torch compares such ints the way shapes are compared:
``rank == 0`` is True only when it holds on every rank, so ``if rank == 0:`` silently ran on
no rank and ``if rank != 0:`` on every one. `rank_node` makes the node of the rank itself
(not of ints computed from it, ``rank % 2``, which keep torch's rule): a comparison in user
code whose answer differs between ranks (``rank == 0``, ``if rank:``, ``rank in (0, 1)``)
raises `RankBranchError` naming the fix; one that every rank answers alike (``rank >= 0``) is
that answer; torch's own comparisons inside an op (``x[rank:]``) keep torch's rule. Turning
the rank into one Python number (``int(rank)``, ``torch.tensor(rank)``) raises too
(``torch.manual_seed(base + rank)`` seeds each rank's stream: LocalTensorMode's own seeding).
"""

from __future__ import annotations

import dis
import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch


class RankBranchError(ValueError):
    """A comparison of the simulated rank that differs between ranks (a Python branch)."""


def _message(op: str, other: object) -> str:
    return (
        f"get_rank() {op} {other!r} differs between the ranks of this simulated world: one "
        "process runs every rank, so a Python `if` on the rank cannot take each rank's way "
        "(it would take one way for all). Compute rank-dependent values with "
        "shardwise.communication.rank_value(lambda r: ...) or torch.where, keep rank-0-only "
        "work (printing, saving) outside the world, or test such code in a real job "
        "(shardwise.testing.run_job)"
    )


def rank_node(local_ints: Mapping[int, int], base: type) -> Any:
    """A node of `base` (torch's ``LocalIntNode``) with each rank's value, whose comparisons
    raise `RankBranchError` when the ranks answer differently.

    Example:
        >>> r = torch.SymInt(rank_node({0: 0, 1: 1}, LocalIntNode))  # doctest: +SKIP
        >>> r >= 0                                                  # doctest: +SKIP
        True
    """
    return _node_class(base)(dict(local_ints))


def _compare(name: str, op: str, test: Callable[[int, int], bool]) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        answers = {test(v, _on_rank(other, r)) for r, v in self._local_ints.items()}
        if len(answers) == 1:
            return torch._C._get_constant_bool_symnode(answers.pop())
        if _user_branch():
            raise RankBranchError(_message(op, _shown(other)))
        return getattr(type(self).__mro__[1], name)(self, other)  # (torch's own rule)

    return method


_TORCH = os.path.dirname(torch.__file__) + os.sep
_BRANCHING = frozenset({"COMPARE_OP", "CONTAINS_OP", "UNARY_NOT", "TO_BOOL"})


def _user_branch() -> bool:
    """Whether the comparison comes from user code comparing or testing the rank (the
    instruction running in the nearest frame outside torch compares, negates or jumps on it),
    not from torch's own code inside an op (slicing with ``x[rank:]`` compares the start
    with 0 in C++, under a subscript instruction): torch's rule is kept for those."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or frame.f_lasti < 0:
        return False
    name = dis.opname[frame.f_code.co_code[frame.f_lasti]]
    return name in _BRANCHING or name.startswith("POP_JUMP")


def _convert(self: Any, *args: Any) -> Any:
    """``int(rank)``, ``float(rank)``, ``torch.tensor(rank)``: one Python number cannot hold
    each rank's value."""
    raise RankBranchError(
        "get_rank() converted to one Python number (int(), float(), torch.tensor(rank)) "
        "differs between the ranks of this simulated world: one process runs every rank, so a "
        "number cannot hold each rank's value. Use the rank in "
        "tensor arithmetic (torch.ones(n) * rank), make rank-dependent values with "
        "shardwise.communication.rank_value(lambda r: ...), or test such code in a real job "
        "(shardwise.testing.run_job)"
    )


@functools.cache
def _node_class(base: type) -> type:
    """`base` with comparisons that refuse to differ between ranks, and conversions to one
    Python number that refuse always."""
    return type(
        "RankIntNode",
        (base,),
        {
            "eq": _compare("eq", "==", lambda a, b: a == b),
            "ne": _compare("ne", "!=", lambda a, b: a != b),
            "lt": _compare("lt", "<", lambda a, b: a < b),
            "le": _compare("le", "<=", lambda a, b: a <= b),
            "gt": _compare("gt", ">", lambda a, b: a > b),
            "ge": _compare("ge", ">=", lambda a, b: a >= b),
            "int_": _convert,
            "guard_int": _convert,
            "guard_float": _convert,
        },
    )


def _on_rank(other: Any, rank: int) -> int:
    """`other` (an int or a node) on `rank`."""
    ints = getattr(other, "_local_ints", None)
    if ints is not None:
        return int(ints[rank])
    constant = getattr(other, "maybe_as_int", None)
    if callable(constant):
        value = constant()
        if value is not None:
            return int(value)
    return int(other)


def _shown(other: Any) -> object:
    ints = getattr(other, "_local_ints", None)
    return "a per-rank int" if ints is not None else _on_rank(other, 0)
