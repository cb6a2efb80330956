"""``torch.Tensor._make_subclass``: how every ``nn.Parameter`` (and ``sw.Parameter``) is built.

`make_subclass` wraps `data` in a tensor subclass without copying it: `parameter/_parameter.py`
builds ``sw.Parameter`` and swaps a parameter's data in place with it. `subclass_data_rewritten`
replaces torch's function for a while, changing the data each subclass instance is made from:
a dry run (`launch/_meta_params.py`) makes every parameter a meta tensor with it.

`make_subclass` looks torch's function up at each call (not bound once), so that a
`subclass_data_rewritten` in force also applies to ``sw.Parameter``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T", bound=torch.Tensor)


def make_subclass(cls: type[T], data: torch.Tensor, requires_grad: bool = False) -> T:
    """An instance of tensor subclass `cls` sharing `data`'s storage."""
    return torch.Tensor._make_subclass(cls, data, requires_grad)


@contextlib.contextmanager
def subclass_data_rewritten(
    rewrite: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Iterator[None]:
    """Within it, ``Tensor._make_subclass(cls, data, ...)`` uses ``rewrite(cls, data)`` for
    `data`; torch's function is put back afterwards."""
    # (torch._dynamo registers a stand-in for the real function, checking its signature, when
    # its polyfills are first imported: imported now, before the function is replaced)
    importlib.import_module("torch._dynamo.polyfills.tensor")
    real = torch.Tensor._make_subclass

    def make(cls: Any, data: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return real(cls, rewrite(cls, data), *args, **kwargs)

    torch.Tensor._make_subclass = staticmethod(make)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor._make_subclass = real  # type: ignore[method-assign]
