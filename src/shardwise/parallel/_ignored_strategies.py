"""The warning of ``parallel_mode="data_parallel"`` about the strategies it does not follow.

That mode runs the whole network on every rank (`optim.DataParallelRunner`): a primitive's
``shard()`` strategies and ``sw.shard``'s op form on an ``nn.Linear`` / ``nn.Embedding`` change
nothing there, and are not even checked against the job. `warn_ignored_strategies` names those
ops (by module path) once, at the wrapper's first call, and says which mode follows them.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

from shardwise.ops import Primitive
from shardwise.planner._graph import op_strategy

_LISTED = 5  # (more annotated ops than this: the first ones and a count)


def annotated_ops(network: nn.Module) -> list[str]:
    """The ops of `network` with a user-set strategy: ``"mm (MatMul)"``, by module path."""
    out = []
    for name, module in network.named_modules():
        where = name or type(network).__name__
        if isinstance(module, Primitive):
            if module.in_strategy is not None or module.out_strategy is not None:
                out.append(f"{where} ({type(module).__name__})")
        elif op_strategy(module) is not None:
            out.append(f"{where} ({type(module).__name__}, sw.shard's op form)")
    return out


def warn_ignored_strategies(network: nn.Module) -> None:
    """Warn (UserWarning) when `network` has annotated ops, whose strategies the data-parallel
    mode does not follow; nothing otherwise."""
    ops = annotated_ops(network)
    if not ops:
        return
    listed = ", ".join(ops[:_LISTED]) + (
        f" and {len(ops) - _LISTED} more" if len(ops) > _LISTED else ""
    )
    warnings.warn(
        f"AutoParallel: parallel_mode='data_parallel' runs the whole network on every rank and "
        f"ignores the strategies set on {listed} (not even checked against the job); use "
        f"parallel_mode='semi_auto' to run them as annotated, or drop the annotations",
        UserWarning,
        stacklevel=_user_level(),
    )


def _user_level() -> int:
    """The warning's stacklevel: the first frame outside torch and shardwise (the user's call
    of the wrapper)."""
    frame, level = sys._getframe(1), 1  # (`warn_ignored_strategies`: level 1)
    while frame.f_back is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    return level


def _internal(frame: object) -> bool:
    globals_ = getattr(frame, "f_globals", {})
    return str(globals_.get("__name__", "")).split(".")[0] in ("torch", "shardwise")
