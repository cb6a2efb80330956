"""The private torch APIs the capture needs, in one place (checked by
tests/test_torch_private_apis.py): fake tensors, a dispatch-level mode, swapping a module's
parameters for fakes, and the exceptions fake tensors raise on data-dependent ops.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
"""Raised by fake tensors when an op's result depends on tensor values."""

__all__ = [
    "DATA_DEPENDENT",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "reparametrize",
]

reparametrize = _reparametrize_module
"""``reparametrize(module, {name: tensor}, tie_weights=True, strict=False)``: a context in which
the module's parameters and buffers are the given tensors."""
