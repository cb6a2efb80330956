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
"""

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
