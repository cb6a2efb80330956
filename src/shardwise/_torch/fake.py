"""Fake tensors: tensors with shapes, dtypes and devices but no data.

Capture (`planner/_capture.py`, `planner/_recorders.py`) runs a train step on fake tensors
(``FakeTensorMode``) to record every op with its global shapes, on any model size, without
memory or compute; ops whose result depends on tensor values raise one of `DATA_DEPENDENT`,
which capture reports with the op's source line; `holds_fake` tells such tensors left in user
objects (`planner/_user_state.py`), also inside a tensor subclass that wraps others;
`quiet_meta_failures` keeps the fake mode from logging the traceback of a meta kernel's error
that capture raises again with the op and the fix; `empty_fake` makes an uninitialized fake
tensor of a mode without dispatching a factory op (capture fakes every parameter: several
times cheaper than ``torch.empty_strided`` under the mode). Only in
``torch._subclasses.fake_tensor`` and ``torch.utils._python_dispatch``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

DATA_DEPENDENT: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
"""Raised by fake tensors when an op's result depends on tensor values."""


def holds_fake(value: Any) -> bool:
    """Whether `value` is a fake tensor, or a tensor subclass wrapping one (through
    ``__tensor_flatten__``: a ``DTensor`` of a fake local tensor)."""
    if isinstance(value, FakeTensor):
        return True
    if not is_traceable_wrapper_subclass(value):
        return False
    names, _ = value.__tensor_flatten__()
    return any(holds_fake(getattr(value, name)) for name in names)


def empty_fake(
    mode: FakeTensorMode,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """An uninitialized fake tensor of `mode` with `shape`, `stride` and `dtype` on `device`:
    what ``torch.empty_strided`` makes under the mode, built from its meta tensor directly."""
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(mode, meta, device)


_LOG = logging.getLogger("torch._subclasses.fake_tensor")  # (the fake mode's own logger)
_META_FAILED = "failed while attempting to run meta for"


def _not_meta_failure(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_META_FAILED)


@contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Within: the fake mode does not log a meta kernel's exception with its traceback (the
    exception itself still propagates, to be reported by the caller)."""
    _LOG.addFilter(_not_meta_failure)
    try:
        yield
    finally:
        _LOG.removeFilter(_not_meta_failure)


__all__ = ["DATA_DEPENDENT", "FakeTensor", "FakeTensorMode", "holds_fake", "quiet_meta_failures"]
