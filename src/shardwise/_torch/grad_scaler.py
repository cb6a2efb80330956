"""One inf/NaN verdict for every rank's ``torch.amp.GradScaler`` (its private check).

``GradScaler.unscale_`` (run by ``scaler.step(optimizer)`` too) checks the gradients it sees
for inf/NaN with its private method ``_unscale_grads_(optimizer, inv_scale, found_inf,
allow_fp16)``, which returns a dict device -> found_inf tensor; ``step`` skips the optimizer step
when their sum is not 0 and ``update`` lowers the scale. When each rank holds only its blocks of
the gradients (model parallel, optimizer parallel), one rank may find an overflow the others do
not see: that rank alone would skip its step and lower its scale. `agree_on_overflow` wraps that
method on one scaler instance so that the found_inf tensors become the maximum over every rank
(`reduce`, an AllReduce(MAX) that the caller provides) before ``step`` and ``update`` read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_MARK = "_shardwise_agreed_overflow"


def agree_on_overflow(
    scaler: Any, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[], None]:
    """From now on, every inf/NaN check of `scaler` (a ``torch.amp.GradScaler``) holds the
    maximum over the ranks: `reduce(t)` returns the maximum of the float32 scalar `t` over every
    rank (called once per check, on every rank). Once per scaler.

    Returns:
        A function that gives the scaler its own check back (nothing for a scaler that was
        already agreeing).

    Example:
        >>> undo = agree_on_overflow(scaler, lambda t: all_reduce(t, ReduceOp.MAX, None))
        >>> undo()  # doctest: +SKIP
    """
    if getattr(scaler, _MARK, False):
        return lambda: None
    check = scaler._unscale_grads_  # (bound: the class's method)

    def agreed(
        optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:  # fmt: skip
        per_device: dict[torch.device, torch.Tensor] = check(
            optimizer, inv_scale, found_inf, allow_fp16
        )
        here = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for v in per_device.values():  # (a rank without gradients adds nothing)
            here = torch.maximum(here, v.to(here.device, torch.float32))
        verdict = reduce(here)
        for v in per_device.values():
            v.copy_(verdict)
        if not per_device:  # (every rank must agree: this rank's verdict on its own device)
            per_device[found_inf.device] = found_inf.copy_(verdict)
        return per_device

    scaler._unscale_grads_ = agreed
    setattr(scaler, _MARK, True)

    def undo() -> None:
        for name in ("_unscale_grads_", _MARK):
            scaler.__dict__.pop(name, None)

    return undo


__all__ = ["agree_on_overflow"]
