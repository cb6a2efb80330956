"""Checkpoint files on disk: per-rank directories, MindSpore naming, rotation, "latest".

- `checkpoint_dir_for_rank`: ``directory/rank_<r>`` when the job has several ranks.
- `checkpoint_filename` / `parse_checkpoint_filename`: ``{prefix}-{epoch}_{step}.safetensors``
  (MindSpore's ``{prefix}-{epoch}_{step}.ckpt`` with the safetensors suffix).
- `list_checkpoints`: a prefix's files, oldest first (by epoch, then step).
- `latest_checkpoint`: the newest one (optionally the newest that loads cleanly).
- `unused_prefix`: ``prefix`` or ``prefix_1``, ``prefix_2`` ... so a new run does not mix its
  files with an earlier run's (what MindSpore's ``ModelCheckpoint`` does).
- `CheckpointManager`: save under the right name in the right directory and keep at most
  ``keep_checkpoint_max`` files, deleting the oldest (the base of ``ModelCheckpoint``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._io import PathLike, load_checkpoint, save_checkpoint

SUFFIX = ".safetensors"


def _is_int(value: object) -> bool:
    """Whether `value` is a plain int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def checkpoint_dir_for_rank(directory: PathLike, rank: int, world_size: int) -> Path:
    """The directory rank ``rank`` writes to: ``directory/rank_<rank>`` if ``world_size > 1``.

    Args:
        directory: the job's checkpoint directory.
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: the number of ranks.

    Returns:
        ``directory`` for a 1-rank job, else ``directory / f"rank_{rank}"``.

    Example:
        >>> checkpoint_dir_for_rank("ckpt", 3, 8)
        PosixPath('ckpt/rank_3')
    """
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    base = Path(directory)
    return base / f"rank_{rank}" if world_size > 1 else base


def _pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)_(\d+){re.escape(SUFFIX)}$")


def checkpoint_filename(prefix: str, epoch: int, step: int) -> str:
    """``f"{prefix}-{epoch}_{step}.safetensors"``.

    Example:
        >>> checkpoint_filename("checkpoint", 2, 1875)
        'checkpoint-2_1875.safetensors'
    """
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty file name part, got {prefix!r}")
    return f"{prefix}-{epoch}_{step}{SUFFIX}"


def parse_checkpoint_filename(name: str, prefix: str) -> tuple[int, int] | None:
    """``(epoch, step)`` from a file name of this prefix, or None if it is not one."""
    found = _pattern(prefix).match(name)
    return (int(found.group(1)), int(found.group(2))) if found else None


def list_checkpoints(directory: PathLike, prefix: str = "checkpoint") -> list[Path]:
    """The checkpoint files of ``prefix`` in ``directory``, oldest (epoch, step) first.

    Example:
        >>> list_checkpoints("no/such/dir")
        []
    """
    base = Path(directory)
    if not base.is_dir():
        return []
    found: list[tuple[int, int, Path]] = []
    for path in base.iterdir():
        parsed = parse_checkpoint_filename(path.name, prefix)
        if parsed is not None and path.is_file():
            found.append((*parsed, path))
    return [path for _, _, path in sorted(found)]


def latest_checkpoint(
    directory: PathLike, prefix: str = "checkpoint", *, verify: bool = False
) -> Path | None:
    """The newest checkpoint of ``prefix`` in ``directory`` (None if there is none).

    Args:
        directory: where to look.
        prefix: the file prefix.
        verify: skip files that do not load cleanly (truncated or corrupt), so the
            result is the newest *usable* checkpoint.

    Returns:
        A path, or None.

    Example:
        >>> latest_checkpoint("no/such/dir") is None
        True
    """
    for path in reversed(list_checkpoints(directory, prefix)):
        if not verify:
            return path
        try:
            load_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def unused_prefix(directory: PathLike | Sequence[PathLike], prefix: str) -> str:
    """``prefix`` if no checkpoint in ``directory`` (or in any of several: a job's rank
    folders) uses it, else the first ``prefix_<n>`` free in all of them.

    Example:
        >>> unused_prefix("no/such/dir", "checkpoint")
        'checkpoint'
    """
    folders = [directory] if isinstance(directory, str | os.PathLike) else list(directory)
    candidate, number = prefix, 0
    while any(list_checkpoints(folder, candidate) for folder in folders):
        number += 1
        candidate = f"{prefix}_{number}"
    return candidate


class CheckpointManager:
    """Save numbered checkpoints and keep only the newest ``keep_checkpoint_max``.

    Args:
        directory: the job's checkpoint directory.
        prefix: file prefix (MindSpore default ``"checkpoint"``).
        keep_checkpoint_max: how many files of this prefix to keep (None = all).
        rank, world_size: with ``world_size > 1`` files go to ``directory/rank_<rank>``.

    Example:
        >>> manager = CheckpointManager("/tmp/sw-doc-ckpt", keep_checkpoint_max=2)
        >>> manager.path_for(epoch=1, step=32).name
        'checkpoint-1_32.safetensors'
    """

    def __init__(
        self,
        directory: PathLike,
        prefix: str = "checkpoint",
        keep_checkpoint_max: int | None = 5,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if keep_checkpoint_max is not None and (
            not _is_int(keep_checkpoint_max) or keep_checkpoint_max < 1
        ):
            raise ValueError(
                f"keep_checkpoint_max must be an int >= 1 or None, got {keep_checkpoint_max!r}"
            )
        checkpoint_filename(prefix, 0, 0)  # validates the prefix
        self.directory = checkpoint_dir_for_rank(directory, rank, world_size)
        self.prefix = prefix
        self.keep_checkpoint_max = keep_checkpoint_max

    def path_for(self, epoch: int, step: int) -> Path:
        """Where the checkpoint of ``(epoch, step)`` goes."""
        return self.directory / checkpoint_filename(self.prefix, epoch, step)

    def save(
        self,
        obj: Any,
        *,
        epoch: int,
        step: int,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
    ) -> Path:
        """`save_checkpoint` to `path_for` (with step/epoch metadata), then rotate.

        Returns:
            The path written.
        """
        path = save_checkpoint(
            obj,
            self.path_for(epoch, step),
            step=step,
            epoch=epoch,
            optimizer=optimizer,
            extra=extra,
        )
        self._rotate()
        return path

    def checkpoints(self) -> list[Path]:
        """This manager's files, oldest first."""
        return list_checkpoints(self.directory, self.prefix)

    def latest(self, *, verify: bool = False) -> Path | None:
        """The newest file (with ``verify``, the newest that loads cleanly)."""
        return latest_checkpoint(self.directory, self.prefix, verify=verify)

    def _rotate(self) -> None:
        if self.keep_checkpoint_max is None:
            return
        files = self.checkpoints()
        for path in files[: max(0, len(files) - self.keep_checkpoint_max)]:
            path.unlink(missing_ok=True)
