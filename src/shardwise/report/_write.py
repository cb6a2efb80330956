"""Writing the reports: `write_ir` (one file, atomically), `write_reports` (both files for some
ranks) and `dump_plan` (what `AutoParallel.plan` calls: reads ``save_graphs`` and
``save_graphs_path`` from `shardwise.context`, does nothing at level 0).

Which ranks `dump_plan` writes: the ranks of the plan this process runs
(`communication.process_ranks`: its own rank in a job), or every rank of the plan when no
process group exists (planning alone).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from shardwise import communication as comm
from shardwise.context import get_context
from shardwise.optim._plan import OptimizerPlan
from shardwise.parallel._plan import NetworkPlan
from shardwise.report._begin import format_step_parallel_begin
from shardwise.report._dataflow import Dataflow, InputState, trace_sources
from shardwise.report._execute import format_execute
from shardwise.report._optimizer import format_optimizer

BEGIN_FILE = "step_parallel_begin.ir"
EXECUTE_FILE = "execute.ir"
_DATASET: dict[str, InputState] = {"data_parallel": "dp", "full_batch": "rep"}


def write_ir(root: str | os.PathLike[str], rank: int, filename: str, text: str) -> Path:
    """Write `text` to ``root/rank_<rank>/filename`` (directories created; the file is written
    to a temporary name in the same directory and renamed, so a reader never sees half a file).

    Returns:
        The path written.
    """
    folder = Path(root) / f"rank_{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / filename
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_reports(
    plan: NetworkPlan,
    flow: Dataflow,
    ranks: Iterable[int],
    root: str | os.PathLike[str],
    level: int = 1,
) -> list[Path]:
    """Write ``step_parallel_begin.ir`` and ``execute.ir`` for each of `ranks` under `root`.

    Raises:
        ValueError: a bad level or a rank outside the plan's matrix (before anything is written).
    """
    texts = [
        (r, format_step_parallel_begin(plan, flow, r, level), format_execute(plan, flow, r, level))
        for r in ranks
    ]
    paths = []
    for r, begin, execute in texts:
        paths.append(write_ir(root, r, BEGIN_FILE, begin))
        paths.append(write_ir(root, r, EXECUTE_FILE, execute))
    return paths


def _ranks(plan: NetworkPlan) -> list[int]:
    if not comm.is_initialized():
        return list(plan.matrix.rank_list)
    mine = comm.process_ranks()
    return [r for r in plan.matrix.rank_list if r in mine]


def _input_states(strategy: str | Sequence[InputState], n: int) -> list[InputState]:
    if isinstance(strategy, str):
        if strategy not in _DATASET:
            raise ValueError(
                f"dump_plan: dataset strategy {strategy!r}; expected one of {sorted(_DATASET)} "
                f"or one state per input"
            )
        return [_DATASET[strategy]] * n
    return list(strategy)


def dump_optimizer(
    optimizer_plan: OptimizerPlan, plan: NetworkPlan, ranks: Iterable[int] | None = None
) -> list[Path]:
    """Append the optimizer-parallel section (`format_optimizer`) to this rank's ``execute.ir``
    if ``get_context("save_graphs") >= 1`` (`AutoParallel.plan` calls it once the engine is
    built, after `dump_plan` wrote the file).

    Returns:
        The paths rewritten (empty at level 0).
    """
    level = int(get_context("save_graphs"))
    if level < 1:
        return []
    root = Path(get_context("save_graphs_path"))
    paths = []
    for r in _ranks(plan) if ranks is None else list(ranks):
        path = root / f"rank_{r}" / EXECUTE_FILE
        before = path.read_text(encoding="utf-8") if path.exists() else ""
        section = format_optimizer(optimizer_plan, plan.matrix, r, level)
        paths.append(write_ir(root, r, EXECUTE_FILE, before + "\n" + section))
    return paths


def dump_plan(
    plan: NetworkPlan,
    network: nn.Module,
    input_shapes: Sequence[Sequence[int]],
    dataset_strategy: str | Sequence[InputState] = "data_parallel",
    ranks: Iterable[int] | None = None,
    input_dtypes: Sequence[torch.dtype] | None = None,
) -> list[Path]:
    """Write this rank's reports of `plan` if ``get_context("save_graphs") >= 1``.

    Call it while the network's wrapper hooks are inactive (`AutoParallel.plan` does, right
    after `plan_network`): the network is traced once more on meta tensors for the data flow.

    Args:
        plan: the plan `AutoParallel.plan` just made.
        network: the planned network (its parameters may already be this rank's blocks).
        input_shapes: the global shapes of the network inputs (those `plan` was made with).
        dataset_strategy: how the inputs arrive: ``"data_parallel"`` (rows split over the
            ranks), ``"full_batch"`` (whole on every rank), or one state per input (``"dp"``,
            ``"rep"`` or a layout on ``plan.matrix``).
        ranks: the ranks to write for; default: see the module docstring.
        input_dtypes: the inputs' dtypes for the meta trace (default float32).

    Returns:
        The paths written (empty at level 0).

    Raises:
        ValueError: an unknown dataset strategy.
    """
    shapes = [tuple(int(n) for n in s) for s in input_shapes]
    states = _input_states(dataset_strategy, len(shapes))
    level = int(get_context("save_graphs"))
    if level < 1:
        return []
    params = {n: s for n, (_, s) in plan.params.items()}
    flow = trace_sources(network, shapes, params, states, input_dtypes)
    chosen = _ranks(plan) if ranks is None else list(ranks)
    return write_reports(plan, flow, chosen, get_context("save_graphs_path"), level)
