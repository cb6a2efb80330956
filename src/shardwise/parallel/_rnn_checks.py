"""Recurrent modules' own hidden-size checks while a plan runs (`rows_hidden_checks`).

``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` check their initial state against the input's batch in
Python (``check_hidden_size``) before the op runs. The plan runs the module on this rank's rows
of the input, while an initial state computed in the step (``torch.zeros(1, b, h) + 0.5``, a
learnable ``h0.expand(-1, b, -1)``) is whole (the op's node cuts its block,
`ops.torch_rules.recurrent_rule`): the check would refuse a call one device runs. The capture
ran these checks on the global shapes, so while the plan runs the batch dim (dim 1 of a batched
state) is left to the op's node; the other dims are still checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise._torch.rnn import HIDDEN_CHECK, hidden_check


def _rows_check(own: Callable[..., Any]) -> Callable[..., None]:
    def check(hx: torch.Tensor, expected: tuple[int, ...], *rest: Any, **kw: Any) -> None:
        if hx.dim() == 3 and len(expected) == 3 and hx.size(1) != expected[1]:
            expected = (expected[0], hx.size(1), expected[2])
        own(hx, expected, *rest, **kw)

    return check


@contextmanager
def rows_hidden_checks(modules: list[nn.RNNBase]) -> Iterator[None]:
    """While the plan runs: the recurrent `modules` take a whole initial state with the
    input's rows (the op's node cuts its block)."""
    patched = []
    for m in modules:
        own = hidden_check(m)
        if own is not None and HIDDEN_CHECK not in vars(m):
            setattr(m, HIDDEN_CHECK, _rows_check(own))
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            delattr(m, HIDDEN_CHECK)
