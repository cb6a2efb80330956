"""Which custom ``torch.autograd.Function`` is running its ``forward`` (torch's frames).

``Function.apply`` is a Python classmethod of ``torch/autograd/function.py`` that calls the
Function's ``forward`` (through torch's C++ ``_FunctionBase.apply``), so while a forward runs
that method's frame is on the call stack with the Function's class as its ``cls``.
`running_function` finds the innermost such frame: the planner marks the ops recorded there
(`planner/_functions.py`). Relies on ``apply`` staying a Python method with a ``cls`` local;
`tests/test_torch_private_apis.py` checks it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

_APPLY = torch.autograd.function.Function.apply.__func__.__code__  # type: ignore[attr-defined]


def running_function(skip: Callable[[type], bool] = lambda cls: False) -> type | None:
    """The class of the innermost custom autograd Function whose ``forward`` is running (those
    `skip` accepts passed over); None outside any.

    Example:
        >>> class Twice(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         print(running_function().__name__)
        ...         return 2 * x
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return 2 * g
        >>> _ = Twice.apply(torch.ones(1))
        Twice
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY:
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and not skip(cls):
                return cls
        frame = frame.f_back  # type: ignore[assignment]
    return None
