"""`ModelCheckpoint` and `CheckpointConfig`: save the network (and optimizer) during training.

Files are ``{prefix}-{epoch}_{step_in_epoch}.safetensors`` (MindSpore's ``.ckpt`` naming) in
``directory`` (``directory/rank_<r>/`` when the job has several ranks), written atomically by
`shardwise.checkpoint.CheckpointManager`, which also keeps at most ``keep_checkpoint_max``.
The epoch is the Model's, counted over all of its ``train()`` calls (`RunContext.
global_epoch_num`), so successive calls write distinct files. Each file holds the optimizer
state, that epoch, the global step, this process's random generators' states (CPU, and
CUDA's when initialized; not in a simulated world) and the own generators' states of the
network's seeded `sw.ops.Dropout` ops, so `resume` can continue training with the identical
loss sequence and data order, dropout's draws included.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import (
    CheckpointManager,
    checkpoint_folder,
    load_checkpoint,
    load_distributed,
    load_optimizer_state,
    load_param_into_net,
    unused_prefix,
)
from shardwise.communication import file_rank, first_claim, process_rng_state
from shardwise.ops import Dropout
from shardwise.train.callbacks import Callback, RunContext

MINDSPORE_ONLY = (
    "save_checkpoint_seconds",
    "keep_checkpoint_per_n_minutes",
    "integrated_save",
    "async_save",
    "saved_network",
    "append_info",
    "enc_key",
    "enc_mode",
    "exception_save",
    "crc_check",
    "remove_redundancy",
    "format",
)
"""MindSpore's ``CheckpointConfig`` arguments that `CheckpointConfig` does not take."""


@dataclass(frozen=True, init=False)
class CheckpointConfig:
    """When to save and how many files to keep.

    Args:
        save_checkpoint_steps: save every this many steps (>= 1).
        keep_checkpoint_max: keep at most this many files (>= 1).
        save_optimizer: store the optimizer state too (needed to resume exactly).

    Raises:
        TypeError: any other argument, MindSpore's `MINDSPORE_ONLY` ones named as such.
    """

    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5
    save_optimizer: bool = True

    def __init__(
        self,
        save_checkpoint_steps: int = 1,
        keep_checkpoint_max: int = 5,
        save_optimizer: bool = True,
        **others: object,
    ) -> None:
        if others:
            theirs = [k for k in others if k in MINDSPORE_ONLY]
            unknown = [k for k in others if k not in MINDSPORE_ONLY]
            said = f"{', '.join(theirs)}: MindSpore's, not supported here" if theirs else ""
            if unknown:
                said += ("; " if said else "") + f"unknown argument(s) {', '.join(unknown)}"
            raise TypeError(
                f"CheckpointConfig: {said}. It takes save_checkpoint_steps, "
                "keep_checkpoint_max and save_optimizer only: save every N steps with "
                "save_checkpoint_steps=N (MindSpore's arguments not supported: "
                f"{', '.join(MINDSPORE_ONLY)})"
            )
        object.__setattr__(self, "save_checkpoint_steps", save_checkpoint_steps)
        object.__setattr__(self, "keep_checkpoint_max", keep_checkpoint_max)
        object.__setattr__(self, "save_optimizer", save_optimizer)
        for name in ("save_checkpoint_steps", "keep_checkpoint_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CheckpointConfig: {name}={value!r} must be an int >= 1")


class ModelCheckpoint(Callback):
    """Save checkpoints every ``config.save_checkpoint_steps`` steps and at the end.

    Args:
        prefix: file prefix; if the directory (any rank's folder of it, in a job of several
            ranks) already holds files with it, ``prefix_1``, ``prefix_2`` ... is used (as
            MindSpore does). The choice is made once, at the first ``train()`` the callback
            is given to: later ``train()`` calls with it write on under that prefix, and
            ``keep_checkpoint_max`` counts the files of all of them, the oldest written first
            deleted (MindSpore's choice, made in ``__init__``, and its rotation).
        directory: where to save (default: the current directory); per rank
            ``directory/rank_<r>/`` in a multi-rank job.
        config: a `CheckpointConfig`.

    Example:
        >>> cfg = sw.train.CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=3)
        >>> model.train(2, data, callbacks=[sw.train.ModelCheckpoint("mnist", "ckpt", cfg)])
    """

    def __init__(
        self,
        prefix: str = "checkpoint",
        directory: str | Path | None = None,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.config = config or CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError("ModelCheckpoint: config must be a CheckpointConfig")
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"ModelCheckpoint: prefix={prefix!r} must be a non-empty string")
        self.prefix, self.directory = prefix, Path(directory or ".")
        self.manager: CheckpointManager | None = None
        self._last_saved = -1
        self._length_unknown = False  # (the last file was saved before the epoch's length)
        self._written: list[Path] = []  # (the files kept, oldest written first)

    def on_train_begin(self, ctx: RunContext) -> None:
        if self.manager is not None:  # (reused by a later train(): MindSpore picks the prefix
            return  # once per callback, so its files and keep_checkpoint_max span the calls)
        rank, size = file_rank()
        probe = CheckpointManager(self.directory, self.prefix, rank=rank, world_size=size)
        prefix = _agreed_prefix(probe.directory, self.prefix, size)
        if size > 1:  # (the first rank's choice: a later rank may see that rank's first files)
            where = (self.directory.resolve(), self.prefix)
            _STARTS[where] = count = _STARTS.get(where, 0) + 1
            prefix = first_claim(f"ckpt_prefix/{where[0]}/{self.prefix}/{count}", prefix)
        # (files are kept by the callback, oldest written first, as MindSpore's: a train()
        # call with an earlier initial_epoch writes names that sort before older files)
        self.manager = CheckpointManager(self.directory, prefix, None, rank=rank, world_size=size)

    def on_train_step_end(self, ctx: RunContext) -> None:
        if ctx.cur_step_num % self.config.save_checkpoint_steps == 0:
            self._save(ctx)

    def on_train_epoch_end(self, ctx: RunContext) -> None:
        # (a dataset without len(): a file saved at the first epoch's last step did not know
        # it was the last; written again, now with the epoch's length, so `resume` takes it)
        if self._length_unknown and self._last_saved == ctx.cur_step_num and ctx.batch_num:
            self._save(ctx)

    def on_train_end(self, ctx: RunContext) -> None:
        if ctx.cur_step_num != self._last_saved and ctx.cur_step_num > 0:
            self._save(ctx)

    def _save(self, ctx: RunContext) -> None:
        assert self.manager is not None, "on_train_begin runs first"
        optimizer = ctx.optimizer if self.config.save_optimizer else None
        path = self.manager.save(
            ctx.network,
            epoch=ctx.global_epoch_num or ctx.cur_epoch_num,  # (the Model's epoch: see _extra)
            step=ctx.step_in_epoch,
            optimizer=optimizer,
            extra=_extra(ctx),
        )
        self._last_saved = ctx.cur_step_num
        self._length_unknown = ctx.batch_num == 0
        if path in self._written:  # (written again: now the newest)
            self._written.remove(path)
        self._written.append(path)
        while len(self._written) > self.config.keep_checkpoint_max:
            self._written.pop(0).unlink(missing_ok=True)

    @property
    def latest(self) -> Path | None:
        """The newest checkpoint this callback wrote (None before training)."""
        return self._written[-1] if self._written else None


_STARTS: dict[tuple[Path, str], int] = {}
"""Trainings this process started with a `ModelCheckpoint` of each directory and prefix (each
rank counts its own alike: one store key per training)."""


def _extra(ctx: RunContext) -> dict[str, Any]:
    """A file's ``extra``: the global step, the epoch's length, the random generators' states
    (`process_rng_state`, base64 in the JSON metadata) and the own generators' states of the
    network's seeded `sw.ops.Dropout` ops by module path (``op_rng``), which `resume` puts
    back. (The file's epoch is the Model's epoch over all its train() calls, the data's epoch,
    which `resume` restores as ``Model.epochs_done``: the next train() sets the data's next
    epoch.)"""
    extra: dict[str, Any] = {"global_step": ctx.cur_step_num, "batch_num": ctx.batch_num}
    states = process_rng_state()
    if states is not None:
        extra["rng"] = {k: _encode(v) for k, v in states.items()}
    extra["op_rng"] = {
        path: {k: _encode(v) for k, v in op.rng_state().items()}
        for path, op in _seeded_dropouts(ctx.network).items()
    }
    return extra


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _seeded_dropouts(network: torch.nn.Module) -> dict[str, Dropout]:
    """The network's `Dropout` ops with generators of their own, by module path."""
    return {path: m for path, m in network.named_modules() if isinstance(m, Dropout) and m.seeded}


def _rng_states(extra: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The generators' states `_extra` stored (None in a file without them)."""
    stored = extra.get("rng")
    if not isinstance(stored, dict) or "cpu" not in stored:
        return None
    return {k: _decode(v) for k, v in stored.items()}


def _set_op_rng(network: torch.nn.Module, extra: dict[str, Any]) -> None:
    """Continue each seeded `Dropout`'s draws from the states `_extra` stored for its path
    (one with none stored starts over from its seeds, as it had drawn nothing at the save);
    nothing for a file without ``op_rng`` (written before it was stored)."""
    stored = extra.get("op_rng")
    if not isinstance(stored, dict):
        return
    for path, op in _seeded_dropouts(network).items():
        op.set_rng_state({k: _decode(v) for k, v in stored.get(path, {}).items()})


def _agreed_prefix(directory: Path, prefix: str, size: int) -> str:
    """`prefix`, or the first free ``prefix_<n>``, free in every rank's folder
    (``directory/rank_*``, which a job of `size` ranks writes; one rank looking at its own alone
    split one job's files over two names when only some folders held an earlier job's). No
    collective: a callback some ranks register alone may not wait for the others."""
    folders = sorted(directory.parent.glob("rank_*")) if size > 1 else []
    return unused_prefix(folders or [directory], prefix)


def resume(model: object, path: str | Path) -> int:
    """Load a `ModelCheckpoint` file into a `Model`'s network and optimizer.

    Args:
        model: the `sw.Model` to continue training.
        path: a checkpoint saved at the end of an epoch (a ``save_checkpoint_steps`` that
            divides the epoch's steps saves at every epoch end; the file written when
            ``train()`` ends is one too); in a multi-rank job, this rank's
            file (``directory/rank_<r>/...``): the checkpoint of all ranks is then loaded with
            `sw.checkpoint.load_distributed` from `sw.checkpoint.checkpoint_folder` (the
            ranks' files beside it, also those of ``ModelCheckpoint(directory=str(rank))``,
            ``<r>/rank_<r>/...``), so any plan or device count may continue it.

    The next ``model.train`` starts from the random generators' states the file holds (this
    process's at the save, in a job this rank's), and each seeded `sw.ops.Dropout` of the
    network continues from its own generator's state at the save (matched by module path), so
    dropout draws as in an uninterrupted run.

    Returns:
        The epochs done, counted over all of the saving Model's ``train()`` calls (the epoch in
        the file's name), to pass as ``initial_epoch``: ``model.train(done + n, data,
        initial_epoch=done)`` and ``model.train(n, data)`` both train ``n`` more epochs with
        an uninterrupted run's data orders (the dataset's ``set_epoch`` counts on from it).

    Raises:
        CheckpointError: the file is damaged or not a checkpoint.
        ValueError: the checkpoint was saved in the middle of an epoch.

    Example:
        >>> done = sw.train.resume(model, "ckpt/checkpoint-1_1875.safetensors")
        >>> model.train(2, data, initial_epoch=done)
    """
    from shardwise.train.model import Model

    if not isinstance(model, Model):
        raise TypeError("resume: model must be a shardwise Model")
    ckpt = load_checkpoint(path)
    extra = ckpt.extra if isinstance(ckpt.extra, dict) else {}
    if ckpt.epoch is None or ckpt.step != extra.get("batch_num"):
        raise ValueError(
            f"resume: {path} was not saved at the end of an epoch (epoch {ckpt.epoch}, step "
            f"{ckpt.step} of {extra.get('batch_num')}); save at epoch ends to resume"
        )
    where = Path(path)
    folder = checkpoint_folder(where)  # (a multi-rank job's file: the folder of all ranks)
    if folder is not None:
        load_distributed(model.network, folder, model.optimizer, name=where.name)
    else:
        load_param_into_net(model.network, ckpt, strict_load=True)
        if model.optimizer is not None and ckpt.optimizer_state is not None:
            load_optimizer_state(model.optimizer, ckpt, model.network)
    model.cur_step_num = int(extra.get("global_step", 0))
    model.epochs_done = int(ckpt.epoch)
    model._resume_rng = _rng_states(extra)  # (put back by the next train(): the draws go on)
    _set_op_rng(model.network, extra)
    return int(ckpt.epoch)
