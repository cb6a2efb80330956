"""The two steps of torch's gradient clipping (``torch.nn.utils.clip_grad``).

``torch.nn.utils.clip_grad_norm_`` (under any name a user imported it by) computes the norm of
the gradients with the module function ``clip_grad._get_total_norm``, then scales them with
``clip_grad._clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)``, both looked up
in the module when it runs. `total_norm_replaced` puts other functions in their place while a
block runs, so every such call clips by the norm they give (shardwise's: of the whole
gradients, `parallel/_clip`); the second one also sees the parameters, which the first does not.
The two-step form ``torch.nn.utils.get_total_norm`` (an alias of the first, looked up on
``torch.nn.utils`` when called by that path; a name imported from there is torch's own) can be
replaced too, and so can ``clip_grad._group_tensors_by_device_and_dtype``, which every function
of the module (``clip_grad_value_`` too) calls on the gradients before it clips them.
`guard_clipping` puts guards in front of these steps for good: each call first asks them for a
function to run instead (none: the step runs as before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.utils as _utils
import torch.nn.utils.clip_grad as _clip_grad

TORCH_TOTAL_NORM: Callable[..., Any] = _clip_grad._get_total_norm
"""torch's own total norm: ``(tensors, norm_type, error_if_nonfinite, foreach) -> norm``."""

TORCH_CLIP_WITH_NORM: Callable[..., Any] = _clip_grad._clip_grads_with_norm_
"""torch's own scaling: ``(parameters, max_norm, total_norm, foreach) -> None``."""


Guard = Callable[[str, tuple[Any, ...]], Callable[..., Any] | None]
"""``guard(step, args) -> instead | None``; `step`: ``"total_norm"``, ``"scale"``, ``"group"``
(``_group_tensors_by_device_and_dtype``) or ``"public"`` (``torch.nn.utils.get_total_norm``)."""

_GUARDS: list[Guard] = []


def guard_clipping(guard: Guard) -> None:
    """From now on every call of torch's clipping steps outside a `total_norm_replaced` block
    (whose steps are the block's own) asks `guard` first (with the call's positional
    arguments): the function it returns runs instead, or with None torch's step."""
    _GUARDS.append(guard)
    _install()


def _install() -> None:
    """The guards in front of the clipping steps in place (again after a `total_norm_replaced`
    block that began before the first guard restored unguarded ones)."""
    if not _GUARDS or getattr(_clip_grad._get_total_norm, "guarded", False):
        return
    _clip_grad._get_total_norm = _guarded("total_norm", _clip_grad._get_total_norm)
    _clip_grad._clip_grads_with_norm_ = _guarded("scale", _clip_grad._clip_grads_with_norm_)
    _utils.get_total_norm = _guarded("public", _utils.get_total_norm)
    group = _clip_grad._group_tensors_by_device_and_dtype  # type: ignore[attr-defined]
    _clip_grad._group_tensors_by_device_and_dtype = _guarded("group", group)  # type: ignore[attr-defined]


def _guarded(step: str, step_fn: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        for guard in _GUARDS:
            instead = guard(step, args)
            if instead is not None:
                return instead(*args, **kwargs)
        return step_fn(*args, **kwargs)

    guarded.guarded = True  # type: ignore[attr-defined]
    return guarded


@contextmanager
def total_norm_replaced(
    total_norm: Callable[..., Any],
    clip_with_norm: Callable[..., Any] | None = None,
    public_total_norm: Callable[..., Any] | None = None,
    grouping: Callable[..., Any] | None = None,
) -> Iterator[None]:
    """While the block runs, torch's clipping takes its total norm from `total_norm` (same
    signature as `TORCH_TOTAL_NORM`) and, when given, scales with `clip_with_norm` (same
    signature as `TORCH_CLIP_WITH_NORM`), ``torch.nn.utils.get_total_norm`` (the two-step
    form, called by that path) is `public_total_norm`, and the module's grouping of the
    gradients (``clip_grad_value_`` calls it) is `grouping`; torch's own are back after it."""
    before = _clip_grad._get_total_norm, _clip_grad._clip_grads_with_norm_
    public = _utils.get_total_norm
    group = _clip_grad._group_tensors_by_device_and_dtype  # type: ignore[attr-defined]
    _clip_grad._get_total_norm = total_norm
    if clip_with_norm is not None:
        _clip_grad._clip_grads_with_norm_ = clip_with_norm
    if public_total_norm is not None:
        _utils.get_total_norm = public_total_norm
    if grouping is not None:
        _clip_grad._group_tensors_by_device_and_dtype = grouping  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _clip_grad._get_total_norm, _clip_grad._clip_grads_with_norm_ = before
        _utils.get_total_norm = public
        _clip_grad._group_tensors_by_device_and_dtype = group  # type: ignore[attr-defined]
        _install()


__all__ = [
    "TORCH_CLIP_WITH_NORM",
    "TORCH_TOTAL_NORM",
    "Guard",
    "guard_clipping",
    "total_norm_replaced",
]
