"""torch's gradient clipping outside a wrapped call under hsdp (the module form, or the
clipping in the user's loop around a wrapped step).

Inside a wrapped call torch's clipping takes the norm of the whole gradients (`_clip`); outside
one torch's own functions would see only this rank's pieces. `watch` registers an engine with
its wrapper's `_clip.clipping` arguments (`clip_args`), and from then on:

- levels 2 and 3 (and level 1 once its gradients are reduced) hold each parameter's reduced
  shard in ``.grad``: ``torch.nn.utils.clip_grad_norm_`` (any name it was imported by) and
  ``torch.nn.utils.get_total_norm`` (by that path) given some of the engine's parameters'
  gradients take the norm of the whole gradients, each shard counted once
  (`_clip._TotalNorm`), so every rank clips by one device's norm; ``clip_grad_value_``
  clamps each element and needs nothing (torch's own);
- level 1 keeps each rank's full gradients on the compute leaves until the optimizer step
  (every held parameter's ``.grad`` is None): while it holds them and the gradients a clipping
  lists are none or some of its parameters' (`_given`), ``clip_grad_norm_`` clips as inside a
  wrapped call: the held gradients reduced first (the ReduceScatter the step would run, moved
  earlier; the step then reduces none), the norm that of the whole gradients, taken when torch
  scales them (`_clip._TotalNorm.scale`); ``clip_grad_value_`` and ``get_total_norm``, which
  list the ``.grad`` tensors before shardwise sees the call (the held ones are missing), raise
  a ValueError naming level 1, a held parameter and the fixes.

The guards sit in front of torch's clipping steps from the first engine on
(`_torch.clip_grad.guard_clipping`); given no gradient of an engine's parameters they change
nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardwise._torch.clip_grad import guard_clipping
from shardwise.parallel._clip import GradSplits, _TotalNorm


class _Engine(Protocol):
    level: str
    params: dict[str, torch.nn.Parameter]
    leaves: dict[str, torch.Tensor]

    def reduce_held(self, reduce: bool = True) -> bool: ...


ClipArgs = Callable[[], tuple[GradSplits, str, Callable[[bool], bool] | None]]

_WATCHED: weakref.WeakKeyDictionary[Any, weakref.WeakMethod[ClipArgs]] = weakref.WeakKeyDictionary()
_SCALING: dict[int, _TotalNorm] = {}  # id(the norm torch got) -> what scales by it
_GUARDING: list[bool] = []

REFUSED = (
    "{what} outside the wrapped call with hsdp optimizer_level 'level1': parameter {name!r}'s "
    "gradient is held unreduced on the compute weights until the optimizer step (its .grad is "
    "None until then), so {missed}; use optimizer_level='level2' or 'level3' (gradients "
    "reduced in backward), the train-step form (AutoParallel(step) with the clipping inside "
    "the step), or clip by norm: torch.nn.utils.clip_grad_norm_ or parallel.clip_grad_norm_ "
    "(they reduce the held gradients first)"
)


def watch(engine: _Engine, clip_args: ClipArgs) -> None:
    """Guard torch's clipping for `engine` (`clip_args`: its wrapper's bound `clip_args`, held
    weakly)."""
    _WATCHED[engine] = weakref.WeakMethod(clip_args)
    if not _GUARDING:
        guard_clipping(_guard)
        _GUARDING.append(True)


def _guard(step: str, args: tuple[Any, ...]) -> Callable[..., Any] | None:
    if step == "scale":
        total = _SCALING.pop(id(args[2]), None) if len(args) > 2 else None
        return None if total is None else total.scale
    grads = _listed(step, args)
    for engine, method in list(_WATCHED.items()):
        clip_args = method()
        if clip_args is None:
            continue
        if not engine.reduce_held(False):  # (the gradients are the reduced shards)
            if step == "group" or not _mine(engine, grads):
                continue  # (value clipping is per element: the shards' own is one device's)
            total = _TotalNorm(*clip_args())
            return total if step == "total_norm" else total.public
        if not _given(engine, grads):
            continue
        if step == "total_norm":
            total = _TotalNorm(*clip_args())
            return lambda *a, **k: _deferred(total, total(*a, **k))
        what, missed = {
            "group": ("torch.nn.utils.clip_grad_value_", "nothing would be clipped"),
            "public": ("torch.nn.utils.get_total_norm", "its norm would leave it out"),
        }[step]
        raise ValueError(REFUSED.format(what=what, name=_held(engine), missed=missed))
    return None


def _deferred(total: _TotalNorm, norm: torch.Tensor) -> torch.Tensor:
    """The norm `total` returned, remembered for its scaling step when it is taken there."""
    if id(norm) in total.deferred:
        _SCALING[id(norm)] = total
    return norm


def _listed(step: str, args: tuple[Any, ...]) -> list[Any]:
    """The gradients the clipping step was given (``_group_tensors_by_device_and_dtype`` takes
    a list of tensor lists)."""
    if not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    listed = list(first)
    if step == "group":
        listed = [t for inner in listed for t in inner]
    return [t for t in listed if isinstance(t, torch.Tensor)]


def _given(engine: _Engine, grads: list[Any]) -> bool:
    """Whether the clipping is of `engine`'s parameters while level 1 holds gradients: no
    gradient listed (the held ones are None), or one of them a parameter's (a member reduced
    in backward)."""
    return not grads or _mine(engine, grads)


def _mine(engine: _Engine, grads: list[Any]) -> bool:
    """Whether some gradient in `grads` is one of `engine`'s parameters' ``.grad``."""
    mine = {id(p.grad) for p in engine.params.values() if p.grad is not None}
    return any(id(g) in mine for g in grads)


def _held(engine: _Engine) -> str:
    """The first parameter whose gradient the engine holds."""
    return next((n for n, leaf in engine.leaves.items() if leaf.grad is not None), "?")
