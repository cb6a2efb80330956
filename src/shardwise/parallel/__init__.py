"""Operator-level parallel runtime (``shardwise.parallel``).

- `AutoParallel` (`_auto`): the semi_auto wrapper; captures and plans the call on the first
  call (`_graph_run.GraphRun`), then runs every call from its `ParallelPlan` (`_executor`).
- `_runtime`: parameter blocks, an op's own collectives, gradient reduction.
- `_local`: Gather's masked lookup, Dropout's global mask and BatchNorm's gathered batch
  statistics (`OpPlan.local`).
- `_step`: dataset strategies (named, per-input tuples / Layouts).
- `_shard`: `shard` and `reshard` (user-set layouts of tensors, functions and parameters).
- `_context`: MindSpore's older global style (`set_auto_parallel_context`, `ParallelMode`),
  read by `AutoParallel` as defaults.

The public names load their modules on first use (PEP 562), so that the planner's capture,
which reads `_discover`, does not import the wrapper, DTensor and the checkpoint code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.checkpoint import unified_safetensors
    from shardwise.parallel._auto import AutoParallel
    from shardwise.parallel._context import (
        ParallelMode,
        get_auto_parallel_context,
        reset_auto_parallel_context,
        set_auto_parallel_context,
    )
    from shardwise.parallel._errors import UnsupportedParallelError
    from shardwise.parallel._shard import reshard, shard

# Each public name and the module it lives in.
_HOMES = {
    "unified_safetensors": "shardwise.checkpoint",
    "AutoParallel": "shardwise.parallel._auto",
    "ParallelMode": "shardwise.parallel._context",
    "get_auto_parallel_context": "shardwise.parallel._context",
    "reset_auto_parallel_context": "shardwise.parallel._context",
    "set_auto_parallel_context": "shardwise.parallel._context",
    "UnsupportedParallelError": "shardwise.parallel._errors",
    "reshard": "shardwise.parallel._shard",
    "shard": "shardwise.parallel._shard",
}

__all__ = [
    "AutoParallel",
    "ParallelMode",
    "UnsupportedParallelError",
    "get_auto_parallel_context",
    "reset_auto_parallel_context",
    "reshard",
    "set_auto_parallel_context",
    "shard",
    "unified_safetensors",
]

if not TYPE_CHECKING:  # type checkers see the imports above

    def __getattr__(name: str) -> Any:
        """Import a public name's module the first time the name is used (PEP 562)."""
        if name not in _HOMES:
            raise AttributeError(f"module 'shardwise.parallel' has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
