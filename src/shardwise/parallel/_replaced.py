"""Parameters replaced in a network between two calls (``net.head = nn.Linear(...)``,
``net.head.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``).

- `registrations`: how many parameters and modules have been registered on any module in this
  process (torch's global registration hooks count them), so a call finds out in one integer
  comparison that nothing was replaced since the last;
- `replaced_names`: the names under which the network holds other parameter objects than a
  run planned with (new objects, or a known one under another name), when something was
  registered;
- `fresh_storage`: the plan's parameter storage without them, so that the next plan takes
  their shapes from the tensors (a value of another shape, a new module) and their layouts
  anew, a value in the old block's shape kept as this rank's block;
- `check_replaced`: optimizer parallel refuses a replaced parameter (its shards and buckets
  are planned once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from shardwise.planner import ParallelPlan

_count = [0]


def _registered(*_: Any) -> None:
    _count[0] += 1


register_module_parameter_registration_hook(_registered)
register_module_module_registration_hook(_registered)


def registrations() -> int:
    """Parameters and modules registered on any module of this process so far."""
    return _count[0]


def replaced_names(
    network: nn.Module, watched: Sequence[nn.Parameter], names: Sequence[str]
) -> tuple[list[str], list[tuple[str, nn.Parameter]]]:
    """(The names under which `network` now holds another parameter object than `watched`
    held under `names`: a new object, or a known one under another name (a tie made since),
    the named parameters now)."""
    named = list(network.named_parameters())
    before = {(n, id(p)) for n, p in zip(names, watched, strict=True)}
    return [n for n, p in named if (n, id(p)) not in before], named


def fresh_storage(plan: ParallelPlan, network: nn.Module, names: Sequence[str]) -> ParallelPlan:
    """`plan` without the storage of the replaced parameters `names`, but for a value of the
    shape of the block the plan stores this rank (a split parameter's own block put back)."""
    values = dict(network.named_parameters())
    keep = {}
    for name, stored in plan.params.items():
        if name in names:
            block = stored.layout.local_shape(stored.shape)
            if (
                name not in values
                or not stored.layout.used_axes()
                or tuple(values[name].shape) != tuple(block)
            ):
                continue
        keep[name] = stored
    return dataclasses.replace(plan, params=keep)


def check_replaced(names: Sequence[str]) -> None:
    """Optimizer parallel keeps the shards and buckets of its first plan: a replaced parameter
    is refused.

    Raises:
        ValueError: naming the parameters and the fix.
    """
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise ValueError(
        f"AutoParallel: parameter(s) {shown} were replaced in the network after the first call "
        f"(new nn.Parameter or module objects); with hsdp() the optimizer-parallel shards and "
        f"buckets are planned once, for the objects of the first call: copy new values into "
        f"the parameters in place (sw.load_param_into_net(net, {{name: value}}), or "
        f"torch.no_grad() and p.copy_(value) on this rank's block), or build the network as it "
        f"trains before wrapping it in a new AutoParallel"
    )
