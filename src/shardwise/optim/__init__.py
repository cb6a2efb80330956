"""``sw.optim``: optimizer-side parallelism.

- `DataParallelRunner` (`_data_parallel`): data-parallel mode, with optional optimizer parallel
  (each parameter updated on its owner rank, then broadcast); its plan (owners, buckets) is
  `_data_parallel_plan`, its collectives and batch cut `_data_parallel_steps`.
- `plan_optimizer` (`_plan`): semi_auto optimizer parallel (hsdp levels 1-3): which parameters
  shard over which ranks, and the fused buckets of their collectives (`OptimizerPlan`).
- `OptimizerParallel` (`_engine`): runs that plan: shards at rest, gathered weights for compute
  (`_engine_gather`), gradients reduce-scattered into the shards in fused buckets
  (`_engine_reduce`; `_groups`: the process groups).
"""

from shardwise.optim._data_parallel import DataParallelRunner
from shardwise.optim._engine import (
    OptimizerParallel,
    check_blocks,
    check_optimizers,
    check_state,
    coupled,
)
from shardwise.optim._plan import (
    Bucket,
    OptimizerPlan,
    ParamInfo,
    ParamShard,
    plan_optimizer,
)
from shardwise.optim._settings import FusionConfig, HsdpConfig, check_fusion, check_hsdp

__all__ = [
    "Bucket",
    "DataParallelRunner",
    "FusionConfig",
    "HsdpConfig",
    "OptimizerParallel",
    "OptimizerPlan",
    "ParamInfo",
    "ParamShard",
    "check_blocks",
    "check_fusion",
    "check_hsdp",
    "check_optimizers",
    "check_state",
    "coupled",
    "plan_optimizer",
]
