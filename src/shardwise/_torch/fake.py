"""Fake tensors: tensors with shapes, dtypes and devices but no data.

Capture (`planner/_capture.py`, `planner/_recorders.py`) runs a train step on fake tensors
(``FakeTensorMode``) to record every op with its global shapes, on any model size, without
memory or compute; ops whose result depends on tensor values raise one of `DATA_DEPENDENT`,
which capture reports with the op's source line; `FakeTensor` tells such tensors left in user
objects (`planner/_user_state.py`). Only in ``torch._subclasses.fake_tensor``.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

DATA_DEPENDENT: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
"""Raised by fake tensors when an op's result depends on tensor values."""

__all__ = ["DATA_DEPENDENT", "FakeTensor", "FakeTensorMode"]
