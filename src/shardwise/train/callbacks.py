"""Training callbacks with MindSpore's names and output formats.

`RunContext` is what every callback sees (MindSpore's ``cb_params``); `Callback` is the base
class with the ``on_train_*`` hooks `Model.train` calls; `LossMonitor` prints
``epoch: 1 step: 20, loss is 2.241283893585205``; `TimeMonitor` prints epoch and per-step time.
`emit()` prints a line without breaking a progress bar that may be on screen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_active_bar: list[Any] = []


def emit(line: str) -> None:
    """Print `line` (through tqdm when a progress bar is on screen) and flush."""
    if _active_bar:
        _active_bar[-1].write(line)
    else:
        print(line, flush=True)


def loss_value(loss: Any) -> float:
    """A Python float of the loss (a tensor, a number or a tuple whose first item is the loss)."""
    if isinstance(loss, tuple | list):
        loss = loss[0]
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().mean().item())
    return float(loss)


@dataclass
class RunContext:
    """The state of a training run, passed to every callback hook.

    Attributes:
        network, optimizer, loss_fn: what `Model` trains.
        epoch_num: epochs to train in this call.
        batch_num: steps per epoch.
        cur_epoch_num: current epoch, 1-based (MindSpore's: counted within this ``train()``
            call, from ``initial_epoch + 1``).
        global_epoch_num: the current epoch counted over all of the Model's ``train()``
            calls (from ``initial_epoch + 1`` when given, as `resume` sets it), 1-based: the
            data's epoch, which `ModelCheckpoint` names its files with. It equals
            `cur_epoch_num` in a single call.
        cur_step_num: steps done since training started (all epochs, and all of the Model's
            ``train()`` calls: MindSpore counts each call's from 0), 1-based at step end.
        epoch_step: steps done in the current epoch (`step_in_epoch`).
        net_outputs: the last step's loss.
        train_dataset, list_callback, dataset_sink_mode, parallel_mode, device_number:
            MindSpore's ``cb_params`` fields of the same names (``train_network``: `network`;
            ``mode``: ``"train"``).
    """

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: Any
    epoch_num: int
    batch_num: int
    cur_epoch_num: int = 0
    cur_step_num: int = 0
    global_epoch_num: int = 0
    net_outputs: Any = None
    stop_requested: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    epoch_step: int = 0
    train_dataset: Any = None
    list_callback: list[Any] = field(default_factory=list)
    dataset_sink_mode: bool = False
    parallel_mode: str = "stand_alone"
    device_number: int = 1
    mode: str = "train"

    @property
    def train_network(self) -> torch.nn.Module:
        """MindSpore's name of the network being trained."""
        return self.network

    @property
    def step_in_epoch(self) -> int:
        """The step number within the current epoch, 1-based (counted in the epoch: right
        after an early stop, in a later ``train()`` call, for a dataset without ``len()``)."""
        if self.epoch_step:
            return self.epoch_step
        return (self.cur_step_num - 1) % max(self.batch_num, 1) + 1  # (a context built by hand)

    def original_args(self) -> RunContext:
        """MindSpore compatibility: ``run_context.original_args()`` is the context itself."""
        return self

    def request_stop(self) -> None:
        """Stop training after the current step."""
        self.stop_requested = True


class Callback:
    """Base class: override any of the hooks; each receives the `RunContext`. As in MindSpore,
    each ``on_train_*`` hook calls the classic hook of the same moment (``begin``,
    ``epoch_begin``, ``step_begin``, ``step_end``, ``epoch_end``, ``end``), so a callback
    written with those runs unchanged."""

    def on_train_begin(self, ctx: RunContext) -> None:
        """Before the first epoch."""
        self.begin(ctx)

    def on_train_epoch_begin(self, ctx: RunContext) -> None:
        """At the start of every epoch."""
        self.epoch_begin(ctx)

    def on_train_step_begin(self, ctx: RunContext) -> None:
        """Before every step."""
        self.step_begin(ctx)

    def on_train_step_end(self, ctx: RunContext) -> None:
        """After every step (``ctx.net_outputs`` holds the loss)."""
        self.step_end(ctx)

    def on_train_epoch_end(self, ctx: RunContext) -> None:
        """At the end of every epoch."""
        self.epoch_end(ctx)

    def on_train_end(self, ctx: RunContext) -> None:
        """After the last epoch."""
        self.end(ctx)

    def begin(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_begin`)."""

    def epoch_begin(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_epoch_begin`)."""

    def step_begin(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_step_begin`)."""

    def step_end(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_step_end`)."""

    def epoch_end(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_epoch_end`)."""

    def end(self, ctx: RunContext) -> None:
        """MindSpore's classic hook (called by `on_train_end`)."""


class LossMonitor(Callback):
    """Print the loss every `per_print_times` steps: ``epoch: 1 step: 20, loss is 2.24...``.

    The steps between prints are the run's (counted across epochs, as MindSpore's
    ``LossMonitor``); the printed step is counted within the epoch, the epoch from 1, as in
    MindSpore's log lines.

    Args:
        per_print_times: print every this many steps (0: never print, as MindSpore's; the
            loss is still checked).

    Raises:
        ValueError: the loss is NaN or infinite (training stops, naming epoch and step).

    Example:
        >>> model.train(1, dataset, callbacks=[sw.train.LossMonitor(20)])
    """

    def __init__(self, per_print_times: int = 1) -> None:
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int):
            raise ValueError(f"LossMonitor: per_print_times={per_print_times!r} must be an int")
        if per_print_times < 0:
            raise ValueError(f"LossMonitor: per_print_times={per_print_times} must be >= 0")
        self.per_print_times = per_print_times
        self._last = 0  # (the run's step it last printed at: MindSpore counts the run's steps)

    def on_train_step_end(self, ctx: RunContext) -> None:
        loss = loss_value(ctx.net_outputs)
        step = ctx.step_in_epoch
        if math.isnan(loss) or math.isinf(loss):
            raise ValueError(
                f"epoch: {ctx.cur_epoch_num} step: {step}. Invalid loss {loss}, terminating "
                "training; lower the learning rate or check the data"
            )
        while self.per_print_times and ctx.cur_step_num <= self._last:  # (reused: MindSpore's
            self._last -= self.per_print_times  # rewind for a run whose steps count again)
        if self.per_print_times and ctx.cur_step_num - self._last >= self.per_print_times:
            self._last = ctx.cur_step_num
            emit(f"epoch: {ctx.cur_epoch_num} step: {step}, loss is {loss}")


class TimeMonitor(Callback):
    """Print ``epoch time: 1234.567 ms, per step time: 12.346 ms`` at the end of each epoch.

    Example:
        >>> model.train(1, dataset, callbacks=[sw.train.TimeMonitor()])
    """

    def __init__(self, data_size: int | None = None) -> None:
        if data_size is not None and (
            isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1
        ):
            raise TypeError(f"TimeMonitor: data_size={data_size!r} must be an int >= 1 or None")
        self.data_size = data_size
        self._start = 0.0
        self._steps = 0

    def on_train_epoch_begin(self, ctx: RunContext) -> None:
        self._start = time.perf_counter()
        self._steps = 0

    def on_train_step_end(self, ctx: RunContext) -> None:
        self._steps += 1

    def on_train_epoch_end(self, ctx: RunContext) -> None:
        ms = (time.perf_counter() - self._start) * 1e3
        steps = self.data_size or self._steps or 1
        emit(f"epoch time: {ms:.3f} ms, per step time: {ms / steps:.3f} ms")
