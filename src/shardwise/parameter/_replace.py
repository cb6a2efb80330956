"""A deferred parameter replaced by a new object, and optimizers re-pointed to it.

`materialize(net, values=...)` puts each value into the deferred tensor object itself
(`assign_tensor`), except a value of another class than ``torch.Tensor`` (a per-rank tensor),
which cannot take over a plain ``nn.Parameter`` object:

- `give`: gives the values; such a value becomes a new ``nn.Parameter`` on every module holding
  the old one (tied weights stay tied), or the module's buffer;
- `retarget`: notes each (old, new) pair; a global optimizer step pre-hook re-points an
  optimizer holding an old parameter to the new one before its next step (`repoint` does it
  at once).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from shardwise._torch.module_state import non_persistent_buffer_names, own_parameters
from shardwise.parameter._parameter import assign_tensor
from shardwise.parameter._replay import Target


def give(obj: torch.nn.Module | torch.Tensor, targets: list[Target], values: list[Any]) -> None:
    """`assign_tensor` of each value into its target, except that a value of another tensor class
    than ``torch.Tensor`` replaces its target on the module (`assign_tensor` keeps the object's
    class, which such a value cannot take)."""
    replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
    for target, value in zip(targets, values, strict=True):
        if type(value) is torch.Tensor or not isinstance(obj, torch.nn.Module):
            assign_tensor(target.tensor, value)
            continue
        path, _, attr = target.name.rpartition(".")
        owner = obj.get_submodule(path) if path else obj
        old = target.tensor
        if attr in own_parameters(owner):
            new = torch.nn.Parameter(value.detach(), requires_grad=old.requires_grad)
            for module in obj.modules():  # (every module holding it: tied weights stay tied)
                for key, held in list(own_parameters(module).items()):
                    if held is old:
                        setattr(module, key, new)
            replaced.append((old, new))
        else:
            persistent = attr not in non_persistent_buffer_names(owner)
            owner.register_buffer(attr, value, persistent=persistent)
    retarget(replaced)


_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
_RETARGET_HOOK: list[RemovableHandle] = []


def retarget(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make optimizers holding an old parameter object step the new one instead (a global
    optimizer step pre-hook re-points their ``param_groups`` before their next step)."""
    for old, new in pairs:
        _REPLACED[id(old)] = (weakref.ref(old), weakref.ref(new))
    if pairs and not _RETARGET_HOOK:
        _RETARGET_HOOK.append(register_optimizer_step_pre_hook(_step_pre_hook))


def repoint(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer` hold the new object of each replaced parameter it holds, now (rather
    than before its next step): for code that reads its ``param_groups`` before it steps."""
    for group in optimizer.param_groups:
        group["params"] = [_current(p) for p in group["params"]]


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if not _REPLACED:
        return
    repoint(optimizer)
    for key in list(_REPLACED):
        old, new = _REPLACED[key]
        if old() is None or new() is None:
            del _REPLACED[key]


def _current(p: torch.Tensor) -> torch.Tensor:
    found = _REPLACED.get(id(p))
    if found is None or found[0]() is not p:
        return p
    new = found[1]()
    return p if new is None else new
