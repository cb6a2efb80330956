"""Parameters made on the meta device while a dry run executes a script (`meta_parameters`).

A dry run must not allocate a model (``shardwise plan`` plans jobs far larger than the host),
but the script's other tensors (data, the DataLoader's seeds) must stay real. Every
``nn.Parameter`` (and ``sw.Parameter``) is built by ``torch.Tensor._make_subclass(cls, data,
requires_grad)``; inside `meta_parameters` that call gets a meta tensor of `data`'s shape and
dtype instead, so parameters hold no memory and init functions on them do nothing. Buffers and
other tensors are untouched. ``_make_subclass`` is private torch API, replaced for the while
by `_torch.subclass.subclass_data_rewritten` (checked by tests/test_torch_private_apis.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardwise._torch.subclass import subclass_data_rewritten


def _on_meta(cls: Any, data: torch.Tensor) -> torch.Tensor:
    """A parameter's data as a meta tensor of its shape and dtype; other data unchanged."""
    if isinstance(cls, type) and issubclass(cls, nn.Parameter) and data.device.type != "meta":
        return torch.empty_like(data, device="meta")
    return data


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within it, every parameter built is a meta tensor (module docstring).

    Example:
        >>> with meta_parameters():
        ...     nn.Linear(4096, 4096).weight.device
        device(type='meta')
    """
    with subclass_data_rewritten(_on_meta):
        yield
