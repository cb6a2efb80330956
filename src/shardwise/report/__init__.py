"""Reports of a parallel plan (``shardwise.report``): MindSpore-style IR dumps per rank and
pictures of the plan.

With ``sw.set_context(save_graphs=1|2|3, save_graphs_path=...)``, `AutoParallel` writes, once
it has planned, per rank ``<path>/rank_<r>/step_parallel_begin.ir`` (every op of the
`ParallelPlan`: global shapes, the placements of its inputs and outputs, where its strategy
came from) and ``<path>/rank_<r>/execute.ir`` (local shapes and every collective the plan
inserts, with this rank's group and the bytes it sends), ``<path>/rank_<r>/plan.html`` (the plan
as a self-contained web page) and, under the first rank, ``plan.png`` (one matplotlib picture).
docs/report.md shows them for seed 003. With optimizer parallel (hsdp / comm_fusion) or gradient
buckets, `dump_optimizer` appends to ``execute.ir`` every collective of each bucket per step.

- `_parallel_plan`: the pure formatters `format_plan_begin` / `format_plan_execute` and
  `dump_parallel_plan`, which writes both files and the pictures, and `next_variant`, the
  number of the next plan written (``_<k>`` after the first: no plan's files overwritten).
- `_sends`: what one rank sends: each edge's and op's collectives with its group and bytes.
- `_optimizer`: the pure formatter `format_optimizer` (the optimizer-parallel section).
- `_write`: `write_ir` (one file, atomically), `report_ranks`, `dump_optimizer` (and
  `with_optimizer`, the text it writes, which ``shardwise plan`` writes too),
  `dump_data_parallel`.
- `_plan_data`: what the pictures show, as data (`plan_memory`: per-rank memory by kind).
- `_html`: `format_plan_html` / `write_plan_html` (``plan.html``).
- `_png`: `render_plan_png` / `write_plan_png` (``plan.png``, matplotlib Agg).
- `_pictures`: `dump_plan_pictures`, the pictures `dump_parallel_plan` writes.
- `_measure`: `MemoryMeter`, the bytes torch's CPU allocator holds in a real run (to compare
  with the estimate of `_summary`).
"""

from shardwise.report._html import format_plan_html, write_plan_html
from shardwise.report._measure import MemoryMeter
from shardwise.report._memory import MemoryEstimate, estimate_memory, memory_tensors
from shardwise.report._optimizer import format_optimizer
from shardwise.report._parallel_plan import (
    dump_parallel_plan,
    format_plan_begin,
    format_plan_execute,
    next_variant,
)
from shardwise.report._plan_data import plan_memory
from shardwise.report._png import render_plan_png, write_plan_png
from shardwise.report._write import dump_data_parallel, dump_optimizer, report_ranks, write_ir

__all__ = [
    "MemoryEstimate",
    "MemoryMeter",
    "dump_data_parallel",
    "dump_optimizer",
    "dump_parallel_plan",
    "estimate_memory",
    "format_optimizer",
    "format_plan_begin",
    "format_plan_execute",
    "format_plan_html",
    "memory_tensors",
    "next_variant",
    "plan_memory",
    "render_plan_png",
    "report_ranks",
    "write_ir",
    "write_plan_html",
    "write_plan_png",
]
