"""The total-norm step of torch's gradient clipping (``torch.nn.utils.clip_grad``).

``torch.nn.utils.clip_grad_norm_`` (under any name a user imported it by) computes the norm of
the gradients with the module function ``clip_grad._get_total_norm`` and then scales them.
`total_norm_replaced` puts another function in its place while a block runs, so every such call
clips by the norm that function gives (shardwise's: of the whole gradients, `parallel/_clip`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.utils.clip_grad as _clip_grad

TORCH_TOTAL_NORM: Callable[..., Any] = _clip_grad._get_total_norm
"""torch's own total norm: ``(tensors, norm_type, error_if_nonfinite, foreach) -> norm``."""


@contextmanager
def total_norm_replaced(total_norm: Callable[..., Any]) -> Iterator[None]:
    """While the block runs, torch's clipping takes its total norm from `total_norm` (same
    signature as `TORCH_TOTAL_NORM`); torch's own is back after it."""
    before = _clip_grad._get_total_norm
    _clip_grad._get_total_norm = total_norm
    try:
        yield
    finally:
        _clip_grad._get_total_norm = before


__all__ = ["TORCH_TOTAL_NORM", "total_norm_replaced"]
