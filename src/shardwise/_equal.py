"""Whether two tensors hold the same values, a NaN equal to a NaN (`torch.equal` says no)."""

from __future__ import annotations

import torch


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have one shape and dtype and hold the same values, NaN equal to NaN.

    Example:
        >>> nan = torch.tensor([float("nan"), 1.0])
        >>> same_values(nan, nan.clone()), torch.equal(nan, nan.clone())
        (True, False)
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() and not a.is_complex():
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
