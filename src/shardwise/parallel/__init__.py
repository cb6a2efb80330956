"""Operator-level parallel runtime (``shardwise.parallel``).

- `AutoParallel` (`_auto`): the semi_auto wrapper; plans on the first call, then runs each
  primitive on this rank's blocks with the collectives its strategy implies.
- `_plan`: step 1, tracing the primitive calls and planning them on one global matrix.
- `_runtime`: steps 2 to 4, parameter blocks, operator collectives, gradient reduction.
- `_local`: Gather's masked lookup and Dropout's global mask (`OpPlan.local`).
- `_step`: train-step wrapping and dataset strategies (named, per-input tuples / Layouts).
- `_shard`: `shard` and `reshard` (user-set layouts of tensors, functions and parameters).
- `_context`: MindSpore's older global style (`set_auto_parallel_context`, `ParallelMode`),
  read by `AutoParallel` as defaults.
"""

from shardwise.parallel._auto import AutoParallel
from shardwise.parallel._context import (
    ParallelMode,
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.parallel._plan import CallPlan, NetworkPlan, PrimitiveCall, plan_network, trace_calls
from shardwise.parallel._shard import reshard, shard

__all__ = [
    "AutoParallel",
    "CallPlan",
    "NetworkPlan",
    "ParallelMode",
    "PrimitiveCall",
    "UnsupportedParallelError",
    "get_auto_parallel_context",
    "plan_network",
    "reset_auto_parallel_context",
    "reshard",
    "set_auto_parallel_context",
    "shard",
    "trace_calls",
]
