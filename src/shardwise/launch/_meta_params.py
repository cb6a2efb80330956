"""Parameters made on the meta device while a dry run executes a script (`meta_parameters`).

A dry run must not allocate a model (``shardwise plan`` plans jobs far larger than the host),
but the script's other tensors (data, the DataLoader's seeds) must stay real. Every
``nn.Parameter`` (and ``sw.Parameter``) is built by ``torch.Tensor._make_subclass(cls, data,
requires_grad)``; inside `meta_parameters` that call gets a meta tensor of `data`'s shape and
dtype instead, so parameters hold no memory and init functions on them do nothing. Buffers and
other tensors are untouched. ``_make_subclass`` is private torch API, used only here (checked by
tests/test_torch_private_apis.py).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within it, every parameter built is a meta tensor (module docstring).

    Example:
        >>> with meta_parameters():
        ...     nn.Linear(4096, 4096).weight.device
        device(type='meta')
    """
    # (torch._dynamo registers a stand-in for the real function, checking its signature, when
    # its polyfills are first imported: imported now, before the function is replaced)
    importlib.import_module("torch._dynamo.polyfills.tensor")
    real = torch.Tensor._make_subclass

    def make(cls: Any, data: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cls, type) and issubclass(cls, nn.Parameter) and data.device.type != "meta":
            data = torch.empty_like(data, device="meta")
        return real(cls, data, *args, **kwargs)

    torch.Tensor._make_subclass = staticmethod(make)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor._make_subclass = real  # type: ignore[method-assign]
