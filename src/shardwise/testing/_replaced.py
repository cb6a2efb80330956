"""The parameters `SimulatedWorld.replicate` replaced, and the check that no optimizer steps them.

`replicate` swaps each parameter of a network for a new per-rank one. An optimizer built
before it holds the originals, which the network no longer uses: its steps updated nothing the
network computes with, and the loss stayed the same, silently. `ReplacedParams` remembers the
originals (weakly, by id) and, from the first `replicate` until the world ends, holds a global
optimizer step pre-hook that raises a ValueError naming the optimizer and the fix when a step
would update one of them. The hook only runs at ``Optimizer.step`` (a lookup per parameter) and
is removed when the world exits.

- `parameter_replica`: the per-rank replica of a parameter, with its shardwise attributes.
- `ReplacedParams.add` / `close`: note an original (registering the hook at the first);
  remove the hook and forget the originals.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardwise.optim._global_hooks import register_pre

_ATTRIBUTES = ("parallel_optimizer", "comm_fusion")


def parameter_replica(
    p: torch.Tensor, same: Callable[[torch.Tensor], torch.Tensor]
) -> torch.nn.Parameter:
    """The replica of parameter `p`: its value held by every rank (`same`), marked a parameter
    as `p` is, with its ``parallel_optimizer`` and ``comm_fusion`` attributes."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # (LocalTensorMode rejects Parameter subclasses)
        plain = torch.Tensor(p.detach()).clone()
    value = torch.nn.Parameter(same(plain), requires_grad=p.requires_grad)
    for attr in _ATTRIBUTES:
        if hasattr(p, attr):
            setattr(value, attr, getattr(p, attr))
    return value


class ReplacedParams:
    """The originals `replicate` replaced in one world, and the step hook that guards them."""

    def __init__(self) -> None:
        # id of an original -> (a weak reference to it, its name in the replicated network)
        self._originals: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._handle: RemovableHandle | None = None

    def add(self, original: torch.Tensor, name: str) -> None:
        """Note that `replicate` replaced `original` (named `name` in its network)."""
        self._originals[id(original)] = (weakref.ref(original), name)
        if self._handle is None:
            self._handle = register_pre(self._check)

    def close(self) -> None:
        """Remove the hook (the world exits: never inside an optimizer step) and forget."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._originals.clear()

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        originals = self._originals
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref, name = originals.get(id(p), (None, ""))
                original = None if ref is None else ref()
                if original is not None and original is p:
                    raise ValueError(
                        f"{type(optimizer).__name__}.step: it updates parameter {name!r} "
                        f"(shape {list(original.shape)}) that world.replicate(net) replaced with a "
                        "per-rank copy: the optimizer was built before replicate and holds "
                        "the original, which the network no longer uses, so training would "
                        "change nothing; build optimizers after world.replicate(net)"
                    )
