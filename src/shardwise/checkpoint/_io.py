"""``sw.save_checkpoint`` and ``sw.load_checkpoint``: safetensors files, written atomically.

- `save_checkpoint`: collect the entries (`_entries`: module state_dict, dict, or
  MindSpore's list of ``{"name", "data"}``), add the optimizer (`optimizer_entries`),
  metadata (for a network a plan has cut: this rank's cut, `_describe.describe`) and
  per-tensor CRC-32 checksums, then `_write_atomically`: a temporary file in
  the same directory, fsync, ``os.replace``, fsync of the directory. A crash leaves either
  the old file or the new one, never a half-written file under the final name.
- `load_checkpoint`: parse with safetensors (no pickle, ever), verify the checksums, split
  model and optimizer entries, and return a `Checkpoint` (a ``dict`` name -> tensor with
  ``.step``, ``.epoch``, ``.extra``, ``.optimizer_state``, ``.path``, ``.metadata``). Any
  truncated, corrupt or foreign file raises `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._describe import describe
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._optimizer import OptimizerState, optimizer_entries

PathLike = str | os.PathLike[str]


class Checkpoint(dict[str, torch.Tensor]):
    """What `load_checkpoint` returns: model entries by name, plus the file's metadata.

    Attributes:
        path: the file it was read from.
        step, epoch: as given to `save_checkpoint` (None when not given).
        extra: the JSON value given as ``extra`` (None when not given).
        optimizer_state: the optimizer part, for ``load_optimizer_state`` (or None).
        metadata: the raw safetensors metadata strings.
    """

    def __init__(
        self,
        entries: Mapping[str, torch.Tensor],
        *,
        path: Path | None = None,
        step: int | None = None,
        epoch: int | None = None,
        extra: Any = None,
        optimizer_state: OptimizerState | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(entries)
        self.path = path
        self.step = step
        self.epoch = epoch
        self.extra = extra
        self.optimizer_state = optimizer_state
        self.metadata: dict[str, str] = dict(metadata or {})


def _from_list(items: Sequence[Any]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, Mapping) or "name" not in item or "data" not in item:
            raise TypeError('a list checkpoint must hold {"name": str, "data": tensor} dicts')
        name = item["name"]
        if not isinstance(name, str) or name in entries:
            raise ValueError(f"list checkpoint names must be unique strings, got {name!r}")
        entries[name] = item["data"]
    return entries


def _entries(obj: object) -> dict[str, Any]:
    if isinstance(obj, torch.nn.Module):
        return dict(obj.state_dict())
    if isinstance(obj, Mapping):
        if not all(isinstance(key, str) for key in obj):
            raise TypeError("checkpoint dict keys must be strings")
        return dict(obj)
    if isinstance(obj, list | tuple):
        return _from_list(obj)
    raise TypeError(
        "save_checkpoint takes an nn.Module, a dict name -> tensor or a list of "
        f'{{"name", "data"}} dicts, got {type(obj).__name__}'
    )


def _metadata(step: int | None, epoch: int | None, extra: Any) -> dict[str, str]:
    fmt.check_count("step", step)
    fmt.check_count("epoch", epoch)
    metadata = {"format": "pt", fmt.KEY_VERSION: fmt.FORMAT_VERSION}
    if step is not None:
        metadata[fmt.KEY_STEP] = str(step)
    if epoch is not None:
        metadata[fmt.KEY_EPOCH] = str(epoch)
    if extra is not None:
        try:
            metadata[fmt.KEY_EXTRA] = json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"extra must be JSON-serializable: {exc}") from exc
    return metadata


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        safetensors.torch.save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def save_checkpoint(
    obj: torch.nn.Module | Mapping[str, torch.Tensor] | Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    step: int | None = None,
    epoch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> Path:
    """Write ``obj`` (and optionally an optimizer) to a safetensors checkpoint, atomically.

    Args:
        obj: an ``nn.Module`` (its ``state_dict()``: parameters and persistent buffers), a
            dict name -> tensor, or MindSpore's list of ``{"name": ..., "data": ...}``.
        path: the file to write, used as given (``.safetensors`` is the convention);
            missing directories are created.
        step, epoch: optional ints >= 0 stored as metadata.
        optimizer: any ``torch.optim`` optimizer; its state is stored by parameter name.
        extra: any JSON-serializable value stored as metadata.

    Returns:
        The path written.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> save_checkpoint(net, "/tmp/sw-doc/net.safetensors", step=10)  # doctest: +SKIP
        PosixPath('/tmp/sw-doc/net.safetensors')
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(
            f"save_checkpoint: {target} is a folder: give the file to write in it, e.g. "
            f"{target / 'checkpoint.safetensors'}"
        )
    metadata = _metadata(step, epoch, extra)
    seen: set[int] = set()
    tensors = {name: fmt.saveable(name, value, seen) for name, value in _entries(obj).items()}
    if optimizer is not None:
        opt_tensors, description = optimizer_entries(optimizer, obj)
        clash = sorted(set(opt_tensors) & set(tensors))
        if clash:
            raise CheckpointError(f"model entries {clash} clash with optimizer entries")
        tensors.update((k, fmt.saveable(k, v, seen)) for k, v in opt_tensors.items())
        metadata[fmt.KEY_OPTIMIZER] = json.dumps(description)
    if isinstance(obj, torch.nn.Module):  # a planned network's rank file records its cut
        metadata.update(describe(obj, tensors, with_optimizer=optimizer is not None))
        _warn_shared_path(metadata, target)
    sums = {name: fmt.checksum(value) for name, value in tensors.items()}
    metadata[fmt.KEY_CHECKSUMS] = json.dumps(sums)
    _write_atomically(tensors, metadata, target)
    return target


def _warn_shared_path(metadata: Mapping[str, str], target: Path) -> None:
    """Warn when this rank's blocks of a cut network go to a file outside a ``rank_<r>``
    folder: other ranks saving the same path overwrite each other (the file keeps one rank's
    blocks), and one rank saving alone (``if rank == 0: save``) keeps its blocks only."""
    pieces = json.loads(metadata.get(fmt.KEY_PIECES, "{}"))
    rank = metadata.get(fmt.KEY_RANK)
    if not pieces or rank is None or target.parent.name == f"rank_{rank}":
        return
    warnings.warn(
        f"save_checkpoint: {target} holds rank {rank}'s blocks only (the network is cut over "
        f"the ranks: {len(pieces)} entries); every rank saves its own file, to "
        f"<folder>/rank_{rank}/{target.name}, and the folder loads with "
        "sw.checkpoint.load_distributed or merges into one file with sw.checkpoint.merge",
        UserWarning,
        stacklevel=3,
    )


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if path.is_dir():
        raise IsADirectoryError(
            f"load_checkpoint: {path} is a folder, not a checkpoint file: a distributed "
            "checkpoint's folder (rank_<r>/ files) loads with sw.checkpoint.load_distributed(net, "
            "folder) or merges into one file with sw.checkpoint.merge(folder, file); in a folder "
            "of saves (CheckpointManager), sw.checkpoint.latest_checkpoint(folder) is the newest "
            "file"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except Exception as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors checkpoint ({exc}); the file is truncated, "
            "corrupt or in another format (shardwise never unpickles)"
        ) from exc
    return tensors, metadata


def _verify(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    sums = fmt.parse_json(path, metadata, fmt.KEY_CHECKSUMS)
    if sums is None:
        return  # a safetensors file from elsewhere: nothing to compare with
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise CheckpointError(f"{path}: checksum table does not match the stored tensors")
    for name, tensor in tensors.items():
        if fmt.checksum(tensor) != sums[name]:
            raise CheckpointError(f"{path}: tensor {name!r} is corrupt (checksum mismatch)")


def load_checkpoint(
    path: PathLike,
    *,
    filter_prefix: str | Sequence[str] | None = None,
    verify: bool = True,
) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint` (or any safetensors file).

    Args:
        path: the ``.safetensors`` file.
        filter_prefix: skip model entries whose names start with this prefix (or any of
            these prefixes), as MindSpore's ``filter_prefix``.
        verify: compare every tensor with its stored CRC-32.

    Returns:
        A `Checkpoint`: ``{name: tensor}`` of model entries (CPU), with ``.step``,
        ``.epoch``, ``.extra``, ``.optimizer_state``, ``.path`` and ``.metadata``.

    Example:
        >>> ckpt = load_checkpoint("run/checkpoint-1_100.safetensors")  # doctest: +SKIP
        >>> ckpt.step, sorted(ckpt)[:1]  # doctest: +SKIP
        (100, ['layer1.bias'])
    """
    source = Path(path)
    tensors, metadata = _read(source)
    if verify:
        _verify(source, tensors, metadata)
    description = fmt.parse_json(source, metadata, fmt.KEY_OPTIMIZER)
    optimizer_state = None
    if description is not None:
        keys = set(description.get("tensors", []))
        if not keys <= set(tensors):
            raise CheckpointError(
                f"{source}: optimizer entries {sorted(keys - set(tensors))} missing"
            )
        optimizer_state = OptimizerState(description, {k: tensors.pop(k) for k in keys})
    prefixes = (filter_prefix,) if isinstance(filter_prefix, str) else tuple(filter_prefix or ())
    entries = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    return Checkpoint(
        entries,
        path=source,
        step=fmt.parse_int(source, metadata, fmt.KEY_STEP),
        epoch=fmt.parse_int(source, metadata, fmt.KEY_EPOCH),
        extra=fmt.parse_json(source, metadata, fmt.KEY_EXTRA),
        optimizer_state=optimizer_state,
        metadata=metadata,
    )
