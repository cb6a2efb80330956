"""Reports of a parallel plan (``shardwise.report``): MindSpore-style IR dumps per rank.

With ``sw.set_context(save_graphs=1|2|3, save_graphs_path=...)``, `AutoParallel` writes, once
it has planned, per rank ``<path>/rank_<r>/step_parallel_begin.ir`` (every op of the
`ParallelPlan`: global shapes, the placements of its inputs and outputs, where its strategy
came from) and ``<path>/rank_<r>/execute.ir`` (local shapes and every collective the plan
inserts, with this rank's group and the bytes it sends). docs/report.md shows both for seed
003. With optimizer parallel (hsdp / comm_fusion) or gradient buckets, `dump_optimizer` appends
to ``execute.ir`` every collective of each bucket per training step.

- `_parallel_plan`: the pure formatters `format_plan_begin` / `format_plan_execute` and
  `dump_parallel_plan`, which writes both files.
- `_optimizer`: the pure formatter `format_optimizer` (the optimizer-parallel section).
- `_write`: `write_ir` (one file, atomically), `report_ranks`, `dump_optimizer`.
"""

from shardwise.report._optimizer import format_optimizer
from shardwise.report._parallel_plan import (
    dump_parallel_plan,
    format_plan_begin,
    format_plan_execute,
)
from shardwise.report._write import dump_optimizer, report_ranks, write_ir

__all__ = [
    "dump_optimizer",
    "dump_parallel_plan",
    "format_optimizer",
    "format_plan_begin",
    "format_plan_execute",
    "report_ranks",
    "write_ir",
]
