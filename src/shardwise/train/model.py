"""`Model`: MindSpore's high-level train / eval loop over a plain torch network.

`Model.train` runs epochs of steps (`_train_step`: forward, loss, backward, optional gradient
reducer, optimizer step) and calls the callbacks' hooks around them; `Model.eval` computes the
metrics (`_metrics`: `Accuracy`, `Loss`), summing the counts over the ranks when the dataset is
sharded per rank. A tqdm progress bar is shown on rank 0 when stdout is a terminal.

As MindSpore's ``Model`` does, training follows `set_auto_parallel_context`: in a job
(``communication.init()`` called) whose context mode is not ``STAND_ALONE``, `_parallel_step`
runs the same train step through `AutoParallel` (semi_auto, sharding propagation or the
data-parallel mode, as the context says), so each rank passes its own rows and every step's
loss is the global batch's, the same on every rank. A network that is a module-form
`AutoParallel` already runs as given (its loss, computed outside it, averaged over the ranks);
it reduces its gradients itself, so a `grad_reducer` with it is refused.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Sequence, Sized
from typing import TYPE_CHECKING, Any

import torch

from shardwise import communication as comm
from shardwise.communication import _collectives as C
from shardwise.train import callbacks as cb
from shardwise.train._eval_data import rows, sharded, trimmed_batches
from shardwise.train._metrics import make_metrics
from shardwise.train._model_checks import (
    batch_loss,
    call_network,
    callback_list,
    check_batches,
    check_epoch_yielded,
    check_loss_fn,
    check_train_args,
    columns,
    one_dataset,
    one_value,
)

if TYPE_CHECKING:
    from shardwise.parallel import AutoParallel

DATASET_NAMES = (("train_dataset", "dataset"), ("valid_dataset", "dataset"))


def _is_rank0() -> bool:
    return 0 in comm.process_ranks()


class Model:
    """Train and evaluate `network` with `loss_fn` and a torch `optimizer`.

    Args:
        network: a `torch.nn.Module`; with `loss_fn` None it must return the loss itself (or
            a tuple whose first item is the loss, e.g. ``(loss, logits)``).
        loss_fn: called as ``loss_fn(network(*inputs), label)`` (the same: a tensor, or a
            tuple whose first item is the loss); None when the network computes the loss.
        optimizer: any `torch.optim.Optimizer` (needed by `train`).
        metrics: names for `eval`: ``"accuracy"`` (``"acc"``), ``"loss"`` (`loss_fn`'s mean
            over the batches), e.g. ``{"accuracy", "loss"}``.
        grad_reducer: called after ``loss.backward()`` and before ``optimizer.step()``, e.g. a
            `sw.nn.DistributedGradReducer` for manual data parallel (``STAND_ALONE`` only).

    Under ``set_auto_parallel_context(parallel_mode=...)`` other than ``STAND_ALONE`` (in a job
    started with ``communication.init()``), `train` runs its step through `sw.AutoParallel`:
    operator parallel as the primitives' ``shard()`` strategies and the context's
    ``search_mode`` / ``dataset_strategy`` say, gradients reduced by it (no `grad_reducer`).
    The network then runs only through that wrapper (`eval` is refused). A module-form
    `sw.AutoParallel` as `network` runs as given; each rank's loss is then its rows' only, and
    the step's loss `train` reports is the mean of the ranks' losses.

    Example:
        >>> model = sw.Model(net, torch.nn.CrossEntropyLoss(), opt, metrics={"accuracy"})
        >>> model.train(1, train_set, callbacks=[sw.train.LossMonitor(20)])
        >>> model.eval(test_set)
        {'accuracy': 0.93}
    """

    def __init__(
        self,
        network: torch.nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Iterable[str] | dict[str, Any] | None = None,
        grad_reducer: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                f"Model: network must be a torch.nn.Module, got {type(network).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Model: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        check_loss_fn(loss_fn)
        from shardwise.parallel import AutoParallel  # (imported here: it imports much)

        if isinstance(network, AutoParallel) and grad_reducer is not None:
            raise ValueError(
                "Model: grad_reducer is for manual parallel, but the network is an AutoParallel, "
                "which reduces the gradients itself; drop grad_reducer"
            )
        self.network, self.loss_fn, self.optimizer = network, loss_fn, optimizer
        self.metrics = make_metrics(metrics, loss_fn)
        self.grad_reducer = grad_reducer
        self.cur_step_num = 0
        self.epochs_done = 0  # (epochs trained over all `train` calls: the data's epoch)
        self._resume_rng: dict[str, torch.Tensor] | None = None  # (`resume`'s, for `train`)
        self.parallel: AutoParallel | None = None  # the train step's wrapper, made by `train`

    def _mode(self) -> str:
        """The parallel mode a `train` call runs in (``"stand_alone"`` without a wrapper)."""
        return str(self.parallel.parallel_mode) if self.parallel is not None else "stand_alone"

    def _parallel_step(self) -> AutoParallel | None:
        """The train step wrapped in `AutoParallel` when the auto-parallel context asks for a
        parallel mode in a job (made once); None for a plain (``STAND_ALONE``) step.

        Raises:
            ValueError: a `grad_reducer` together with a parallel mode.
        """
        from shardwise.parallel import AutoParallel, ParallelMode, get_auto_parallel_context

        # (imported here: shardwise.parallel imports much of the package)

        if self.parallel is not None:
            return self.parallel
        mode = get_auto_parallel_context("parallel_mode")
        if mode == ParallelMode.STAND_ALONE or not comm.is_initialized():
            return None
        if self.grad_reducer is not None:
            raise ValueError(
                f"Model: grad_reducer is for manual parallel, but set_auto_parallel_context("
                f"parallel_mode={mode!r}) makes AutoParallel reduce the gradients; drop "
                "grad_reducer or set parallel_mode=ParallelMode.STAND_ALONE"
            )
        if isinstance(self.network, AutoParallel):  # (wrapped already: runs as given)
            return None
        network, loss_fn, optimizer = self.network, self.loss_fn, self.optimizer
        assert optimizer is not None

        def train_step(*batch: torch.Tensor) -> torch.Tensor:
            loss = batch_loss(network, loss_fn, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        self.parallel = AutoParallel(train_step, network=network, optimizer=optimizer)
        return self.parallel

    def _train_step(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        assert self.optimizer is not None
        parallel = self._parallel_step()
        given = columns(batch, 1 if self.loss_fn is None else 2)
        if parallel is not None:
            out: torch.Tensor = parallel(*given)
            return out.detach()
        self.optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(self.network, self.loss_fn, given)
        loss.backward()
        if self.grad_reducer is not None:
            self.grad_reducer()
        self.optimizer.step()
        detached: torch.Tensor = loss.detach()
        if self._rank_rows_loss():  # (the loss the job reports: the same on every rank)
            world = comm.get_group_size()
            detached = C.all_reduce(detached, C.ReduceOp.SUM, None) / world
        return detached

    def _rank_rows_loss(self) -> bool:
        """Whether the loss `_train_step` computes is this rank's rows' only: the network is a
        module-form `AutoParallel` each rank passes its rows to (its outputs leave as those
        rows), in a job of several ranks."""
        from shardwise.parallel import AutoParallel

        net = self.network
        return (
            isinstance(net, AutoParallel)
            and net.train_step is None
            and net.rows_per_rank
            and comm.is_initialized()
            and comm.get_group_size() > 1
        )

    def train(
        self,
        epoch: int,
        train_dataset: Iterable[Sequence[torch.Tensor]] | None = None,
        callbacks: Sequence[cb.Callback] | cb.Callback | None = None,
        dataset_sink_mode: bool = False,
        sink_size: int = -1,
        initial_epoch: int = 0,
        *,
        dataset: Iterable[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """Train for epochs ``initial_epoch + 1 .. epoch`` over `train_dataset` (MindSpore's
        signature and argument order).

        Args:
            epoch: the last epoch number (MindSpore semantics with `initial_epoch`).
            train_dataset: yields tuples ``(*inputs, label)`` of tensors.
            callbacks: `Callback`s (LossMonitor, TimeMonitor, ModelCheckpoint ...).
            dataset_sink_mode: accepted for MindSpore scripts; PyTorch has no device sink, so
                True runs the same loop (with a warning).
            sink_size: accepted for MindSpore scripts (-1 or a count >= 1); without a device
                sink every epoch is the whole dataset.
            initial_epoch: epochs already done (resuming from a checkpoint).
            dataset: `train_dataset` by the name ``train(epoch, dataset=...)`` uses.

        Each epoch tells the dataset (or a DataLoader's sampler, a ``DistributedSampler``) its
        epoch with ``set_epoch``, counted over all of this Model's `train` calls (from
        `initial_epoch` when given, as `resume` sets it), so ``train(1, data)`` called E times
        sees the data orders of one ``train(E, data)`` call.

        Raises:
            ValueError: no optimizer, a bad epoch count, or an invalid loss (LossMonitor).
            TypeError: the dataset given twice (`train_dataset` and `dataset`) or not at all.
        """
        train_dataset = one_dataset("Model.train", train_dataset, dataset, DATASET_NAMES[0])
        if self.optimizer is None:
            raise ValueError("Model.train: pass optimizer= to Model to train")
        check_train_args(epoch, initial_epoch, sink_size)
        if dataset_sink_mode:
            warnings.warn("dataset_sink_mode=True has no effect in shardwise", stacklevel=2)
        self._parallel_step()  # (a parallel mode's errors before any callback runs)
        cbs = callback_list(callbacks)
        known = _length(train_dataset)
        check_batches(train_dataset, known)
        batch_num = known or 0
        ctx = cb.RunContext(
            self.network, self.optimizer, self.loss_fn, epoch, batch_num, initial_epoch,
            self.cur_step_num, train_dataset=train_dataset, list_callback=cbs,
            dataset_sink_mode=dataset_sink_mode, parallel_mode=self._mode(),
            device_number=comm.get_group_size() if comm.is_initialized() else 1,
        )  # fmt: skip
        self.network.train()
        if self._resume_rng is not None:  # (the random draws go on from the checkpoint's)
            comm.set_process_rng_state(self._resume_rng)
            self._resume_rng = None
        for c in cbs:
            c.on_train_begin(ctx)
        done = initial_epoch or self.epochs_done  # (the data's epochs before this call's)
        for ep in range(initial_epoch + 1, epoch + 1):
            ctx.cur_epoch_num = ep
            done += 1
            ctx.global_epoch_num = done
            self._run_epoch(ctx, train_dataset, cbs, done - 1)
            self.epochs_done = done  # (after it: a call failing in an epoch does not count it)
            if ctx.stop_requested:
                break
        for c in cbs:
            c.on_train_end(ctx)

    def _run_epoch(
        self,
        ctx: cb.RunContext,
        data: Iterable[Sequence[torch.Tensor]],
        cbs: list[cb.Callback],
        data_epoch: int,
    ) -> None:
        # (`data_epoch` counts over all `train` calls, so a resumed run, and one train(1, ..)
        # call per epoch, see the same data order as one uninterrupted call; a DataLoader's
        # DistributedSampler is told the epoch too, as a hand-written DDP loop would)
        batches = getattr(data, "batch_sampler", None)  # (a DataLoader's BatchSampler)
        for holder in (data, getattr(data, "sampler", None), getattr(batches, "sampler", None)):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(data_epoch)
                break
        ctx.epoch_step = 0
        for c in cbs:
            c.on_train_epoch_begin(ctx)
        with _progress(ctx) as bar:
            for batch in data:
                for c in cbs:
                    c.on_train_step_begin(ctx)
                ctx.net_outputs = self._train_step(batch)
                ctx.cur_step_num += 1
                ctx.epoch_step += 1
                self.cur_step_num = ctx.cur_step_num
                if bar is not None:
                    bar.update(1)
                for c in cbs:
                    c.on_train_step_end(ctx)
                if ctx.stop_requested:
                    break
        if ctx.batch_num == 0 and not ctx.stop_requested:  # (no len(): the first epoch's
            check_batches(data, ctx.epoch_step)  # steps, when it ran to its end)
            ctx.batch_num = ctx.epoch_step
        elif not ctx.stop_requested:  # (an iterator used up by an earlier epoch)
            check_epoch_yielded(data, ctx.cur_epoch_num, ctx.epoch_step, ctx.batch_num)
        for c in cbs:
            c.on_train_epoch_end(ctx)

    @torch.no_grad()
    def eval(
        self,
        valid_dataset: Iterable[Sequence[torch.Tensor]] | None = None,
        dataset_sink_mode: bool = False,
        *,
        dataset: Iterable[Sequence[torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        """Compute the metrics over `valid_dataset` (``{"accuracy": 0.93}``; ``dataset=`` is
        the same argument by another name; TypeError when given twice or not at all).

        When the dataset is sharded over the ranks (``num_shards > 1``, or a torch DataLoader
        over a ``DistributedSampler`` of several replicas), the padding rows of each rank's last
        batch (a pipeline's wrap-around rows, the sampler's repeated ones) are not counted and
        the counts are summed over the world group, so every rank returns one device's value.
        """
        valid_dataset = one_dataset("Model.eval", valid_dataset, dataset, DATASET_NAMES[1])
        if not self.metrics:
            raise ValueError("Model.eval: pass metrics={'accuracy'} to Model to evaluate")
        if self.parallel is not None and self.parallel.holds_blocks:
            raise ValueError(
                "Model.eval: the network was trained under AutoParallel (set_auto_parallel_"
                "context) and its parameters hold this rank's blocks or optimizer-parallel "
                "shards; evaluate through the module form, sw.Model(sw.AutoParallel(net), "
                "metrics=...), or a Model built with parallel_mode=ParallelMode.STAND_ALONE on a "
                "network with whole parameters (sw.checkpoint.merge of its checkpoints)"
            )
        was_training = self.network.training
        self.network.eval()
        state = {name: make() for name, make in self.metrics.items()}
        for inputs, label, kept in trimmed_batches(valid_dataset):
            # (the whole batch: every rank makes the same calls)
            logits = call_network(self.network, inputs, True, "eval")
            counted = (logits, label) if kept == len(label) else rows(logits, label, kept)
            for m in state.values():
                m.update(*counted, whole=(logits, label))
        self.network.train(was_training)
        over_ranks = sharded(valid_dataset)
        out = {}
        for name, m in state.items():
            counts = m.counts()
            if over_ranks and comm.is_initialized():
                if hasattr(m, "padded"):  # (per-batch counts: one length on every rank)
                    longest = torch.tensor([counts.shape[1]], device=counts.device)
                    longest = C.all_reduce(longest, C.ReduceOp.MAX, None)
                    counts = m.padded(counts, int(one_value(longest, name)))
                counts = C.all_reduce(counts, C.ReduceOp.SUM, None)
            out[name] = m.result(one_value(counts, name))
        return out


def _length(data: object) -> int | None:
    """The batches of an epoch of `data`, or None when it has no length (a generator; a
    DataLoader over an IterableDataset, whose ``len()`` raises TypeError)."""
    try:
        return len(data) if isinstance(data, Sized) else None
    except TypeError:
        return None


class _progress:
    """A tqdm bar over one epoch, on rank 0 when stdout is a terminal; else nothing."""

    def __init__(self, ctx: cb.RunContext) -> None:
        self.ctx = ctx
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not (sys.stdout.isatty() and _is_rank0()):
            return None
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]
        except ImportError:  # pragma: no cover - tqdm is a dependency
            return None
        total = self.ctx.batch_num or None
        self.bar = tqdm(total=total, desc=f"epoch {self.ctx.cur_epoch_num}", leave=False)
        cb._active_bar.append(self.bar)
        return self.bar

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            cb._active_bar.remove(self.bar)
            self.bar.close()
