"""Reports of a parallel plan (``shardwise.report``): MindSpore-style IR dumps per rank.

With ``sw.set_context(save_graphs=1|2|3, save_graphs_path=...)``, `dump_plan` (called by
`AutoParallel.plan`) writes per rank ``<path>/rank_<r>/step_parallel_begin.ir`` (every primitive
call: global input shapes, in_strategy / out_strategy and who set them, the device matrix) and
``<path>/rank_<r>/execute.ir`` (local shapes and every inserted communication op with this
rank's group). docs/report.md shows both for seed 003. With optimizer parallel (hsdp /
comm_fusion), `dump_optimizer` appends to ``execute.ir`` every collective of each bucket per
training step.

- `_dataflow`: `trace_sources` (which value feeds each primitive input) and the redistribution
  the runtime will do for each input (`input_redistributions`), without running anything.
- `_begin` / `_execute`: the pure formatters `format_step_parallel_begin` / `format_execute`.
- `_optimizer`: the pure formatter `format_optimizer` (the optimizer-parallel section).
- `_write`: `write_reports` (directories, atomic writes), `dump_plan` and `dump_optimizer`.
- `_parallel_plan`: the same two files for a `planner.ParallelPlan` (`dump_parallel_plan`).
"""

from shardwise.report._begin import format_step_parallel_begin
from shardwise.report._dataflow import (
    Dataflow,
    Source,
    input_redistributions,
    output_redistributions,
    trace_sources,
)
from shardwise.report._execute import format_execute
from shardwise.report._optimizer import format_optimizer
from shardwise.report._parallel_plan import (
    dump_parallel_plan,
    format_plan_begin,
    format_plan_execute,
)
from shardwise.report._write import dump_optimizer, dump_plan, write_ir, write_reports

__all__ = [
    "Dataflow",
    "Source",
    "dump_optimizer",
    "dump_parallel_plan",
    "dump_plan",
    "format_execute",
    "format_optimizer",
    "format_plan_begin",
    "format_plan_execute",
    "format_step_parallel_begin",
    "input_redistributions",
    "output_redistributions",
    "trace_sources",
    "write_ir",
    "write_reports",
]
