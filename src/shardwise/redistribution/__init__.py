"""Redistribution: move a tensor from one layout to another with local slices, AllGather and
AlltoAll (never AllReduce).

- `_steps`: the step kinds `Slice`, `AllGather`, `AlltoAll`; `apply_step` (a layout after a
  step), `legal_steps`, `step_bytes` (the cost model); `gather_runs` (the steps as they run:
  AllGathers of one dim over several axes as one), `run_axes`, `describe_run`.
- `_plan`: `plan_redistribution` (Dijkstra over layouts, minimal bytes per rank) and the
  printable `RedistributionPlan`.
- `_execute`: `redistribute`, which runs a plan on this rank's local block with the
  autograd-aware collectives; `block_offset` (where this rank's block of a dim starts);
  `local_block` (a whole tensor cut to this rank's block).
"""

from shardwise.redistribution._execute import block_offset, local_block, redistribute
from shardwise.redistribution._plan import RedistributionPlan, plan_redistribution
from shardwise.redistribution._steps import (
    AllGather,
    AlltoAll,
    Slice,
    Step,
    apply_step,
    describe_run,
    gather_runs,
    run_axes,
)

__all__ = [
    "AllGather",
    "AlltoAll",
    "RedistributionPlan",
    "Slice",
    "Step",
    "apply_step",
    "block_offset",
    "describe_run",
    "gather_runs",
    "local_block",
    "plan_redistribution",
    "redistribute",
    "run_axes",
]
