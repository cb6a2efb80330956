"""Writing the reports: `write_ir` (one file, atomically, under ``rank_<r>/``), `report_ranks`
(the ranks this process writes), `dump_optimizer` (the optimizer-parallel section appended
to ``execute.ir``: `with_optimizer`) and `dump_data_parallel` (data_parallel mode's
``execute.ir``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from pathlib import Path

from shardwise import communication as comm
from shardwise._atomic import write_text_atomically
from shardwise.context import get_context
from shardwise.layout import DeviceMatrix
from shardwise.optim._plan import OptimizerPlan
from shardwise.report._optimizer import format_optimizer

BEGIN_FILE = "step_parallel_begin.ir"
EXECUTE_FILE = "execute.ir"


def write_ir(root: str | os.PathLike[str], rank: int, filename: str, text: str) -> Path:
    """Write `text` to ``root/rank_<rank>/filename``, ending in a newline (directories
    created; the file is written to a temporary name in the same directory and renamed, so a
    reader never sees half a file).

    Returns:
        The path written.
    """
    ended = text if text.endswith("\n") else text + "\n"
    return write_text_atomically(Path(root) / f"rank_{rank}" / filename, ended)


def report_ranks(matrix: DeviceMatrix) -> list[int]:
    """The ranks of `matrix` whose reports this process writes (every rank without a process
    group, as in a simulated world or a dry run)."""
    if not comm.is_initialized():
        return list(matrix.rank_list)
    mine = comm.process_ranks()
    return [r for r in matrix.rank_list if r in mine]


def dump_optimizer(
    optimizer_plan: OptimizerPlan,
    matrix: DeviceMatrix,
    ranks: Iterable[int] | None = None,
    variant: int = 0,
    regathered: Collection[str] | None = None,
) -> list[Path]:
    """Append the optimizer-parallel section (`format_optimizer`) to this rank's ``execute.ir``
    if ``get_context("save_graphs") >= 1`` (`AutoParallel` calls it once the engine is built,
    after `dump_parallel_plan` wrote the file).

    Args:
        optimizer_plan: the buckets (`AutoParallel.optimizer_plan`).
        matrix: the plan's device matrix.
        ranks: the ranks to write (default: this process's ranks of `matrix`).
        variant: the plan's variant (k > 0: ``execute_<k>.ir``, a plan made again).
        regathered: the parameters a level-3 backward gathers again
            (`planner.regathered_params` of the op-level plan); None: every shard bucket's.

    Returns:
        The paths rewritten (empty at level 0).
    """
    level = int(get_context("save_graphs"))
    if level < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    name = EXECUTE_FILE.replace(".ir", f"_{variant}.ir") if variant else EXECUTE_FILE
    paths = []
    for r in report_ranks(matrix) if ranks is None else list(ranks):
        path = root / f"rank_{r}" / name
        before = path.read_text(encoding="utf-8") if path.exists() else ""
        text = with_optimizer(before, optimizer_plan, matrix, r, level, regathered)
        paths.append(write_ir(root, r, name, text))
    return paths


def with_optimizer(
    execute: str,
    optimizer_plan: OptimizerPlan,
    matrix: DeviceMatrix,
    rank: int,
    level: int = 1,
    regathered: Collection[str] | None = None,
) -> str:
    """`execute` (rank `rank`'s ``execute.ir`` text) followed by its optimizer-parallel
    section (`format_optimizer`), as `dump_optimizer` writes it (``shardwise plan`` too).

    Example:
        >>> text = with_optimizer(format_plan_execute(plan, 0), net.optimizer_plan, plan.matrix, 0)
    """
    return execute + "\n" + format_optimizer(optimizer_plan, matrix, rank, level, regathered)


def dump_data_parallel(text: str) -> list[Path]:
    """Write `text` (a `DataParallelRunner`'s plan: each parameter's owner, fusion id and
    buckets, the collectives per step) as this process's ranks' ``execute.ir`` if
    ``get_context("save_graphs") >= 1`` (``parallel_mode="data_parallel"``: no operator plan).

    Returns:
        The paths written (empty at level 0).
    """
    if int(get_context("save_graphs")) < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    head = f"# execute: data_parallel on {comm.get_group_size()} ranks (the whole network each)\n"
    return [write_ir(root, r, EXECUTE_FILE, head + text + "\n") for r in comm.process_ranks()]
