"""The private torch APIs the capture needs, in one place (checked by
tests/test_torch_private_apis.py): fake tensors, a dispatch-level mode, swapping a module's
parameters for fakes (``Module._parameters`` / ``_buffers``), and the exceptions fake tensors
raise on data-dependent ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
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


@contextmanager
def reparametrize(network: nn.Module, by_id: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """A context in which every parameter and buffer of `network` whose id is in `by_id` is
    replaced (in each module holding it: tied weights stay tied) by that tensor; the very same
    objects are put back afterwards (``Module._parameters`` / ``_buffers``)."""
    saved = []
    for module in network.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in by_id:
                    saved.append((table, name, t))
                    table[name] = by_id[id(t)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for table, name, t in saved:
            table[name] = t  # type: ignore[assignment]
