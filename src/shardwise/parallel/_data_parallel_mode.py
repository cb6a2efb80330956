"""``parallel_mode="data_parallel"``'s start (`start_runner`): the whole network on every rank,
run by `optim.DataParallelRunner` (gradients all-reduced at the optimizer step; with `hsdp`,
each parameter updated by its owner and broadcast: seed 001's data-parallel variant), after the
warnings of what that mode ignores (a network sharing a parameter with another wrapper's
refused: `_ownership.refuse_shared`), with its report and the train step's GradScalers agreed;
torch's clipping outside a call over gradients not yet averaged is refused
(`_held_clip.watch_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import report
from shardwise.optim import DataParallelRunner, HsdpConfig
from shardwise.parallel._discover import agree_scalers
from shardwise.parallel._held_clip import watch_data_parallel
from shardwise.parallel._ignored_strategies import warn_ignored_strategies
from shardwise.parallel._observe import notify_unplanned
from shardwise.parallel._ownership import refuse_shared
from shardwise.parallel._step import DatasetStrategy


def start_runner(
    network: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    train_step: Callable[..., Any] | None,
    hsdp: HsdpConfig | None,
    fusion: dict[str, Any],
    dataset: DatasetStrategy,
) -> tuple[DataParallelRunner, list[Callable[[], None]]]:
    """The runner of a data_parallel-mode wrapper's first call and the undo functions of its
    train step's GradScalers (each checks this rank's gradients: one verdict for all ranks).

    Example:
        >>> runner, undo = start_runner(net, [opt], None, None, {}, "data_parallel")
    """
    refuse_shared(network, train_step, data_parallel=True)  # (another wrapper's parameter)
    notify_unplanned("data_parallel")
    warn_ignored_strategies(network)
    runner = DataParallelRunner(
        network,
        list(optimizers),
        train_step=train_step,
        parallel_optimizer=hsdp is not None,
        threshold_kb=hsdp.threshold if hsdp is not None else 64,
        fusion=fusion or None,
        dataset_strategy=dataset,
    )
    report.dump_data_parallel(str(runner))
    watch_data_parallel(runner)  # (torch's clipping outside a call: refused before the step)
    undo = agree_scalers(train_step) if train_step is not None else []
    return runner, undo
