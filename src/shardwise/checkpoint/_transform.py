"""Re-cut a distributed checkpoint for another plan or device count, or merge it into one file.

- `transform`: every destination rank's file, entry by entry: each block assembled from the
  source blocks that overlap it (`SourceSet.assemble`) and streamed to disk (`StreamWriter`),
  so at most one destination block and one source block are in memory at a time (two buffers
  reused for every entry, sized for the largest). Everything is
  written into a hidden folder next to the destination, which is renamed into place at the end
  (`_publish`): a killed transform leaves the destination absent (or, with ``overwrite``, the
  old one), never half written; the next transform to that destination removes the hidden
  output a killed one of this host left.
- `merge`: the whole tensors of the model entries in one safetensors file that plain
  ``model.load_state_dict(safetensors.torch.load_file(path))`` loads.
- `transform_checkpoints` / `unified_safetensors`: MindSpore's names and arguments for the two.
- `Blocks`: what `_cut` reads (a `SourceSet`; `import_dcp` gives a torch DCP checkpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._describe import strategy_metadata
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._manager import checkpoint_dir_for_rank
from shardwise.checkpoint._pieces import Piece
from shardwise.checkpoint._sources import Buffers, SourceSet
from shardwise.checkpoint._strategy import CheckpointStrategy, as_strategy
from shardwise.checkpoint._stream import StreamWriter

PathLike = str | os.PathLike[str]
_PROGRESS_BYTES = 64 << 20  # a progress bar for checkpoints from this size on
_OWNER = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())  # a partial output's host
_KEEP = (fmt.KEY_VERSION, fmt.KEY_STEP, fmt.KEY_EPOCH, fmt.KEY_EXTRA, fmt.KEY_OPTIMIZER)


class Blocks(Protocol):
    """What `_cut` reads: a checkpoint's entries (a `SourceSet`, or an imported DCP one)."""

    @property
    def names(self) -> Sequence[str]: ...

    @property
    def metadata(self) -> Mapping[str, str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def assemble(self, key: str, target: Piece, buffers: Buffers | None = None) -> torch.Tensor: ...


def _check_fits(source: Blocks, dst: CheckpointStrategy) -> None:
    """The destination strategy's parameters are the checkpoint's, with the same shapes, and
    their layouts divide them."""
    for name, p in dst.params.items():
        if name not in source.names:
            raise CheckpointError(
                f"the destination strategy has parameter {name!r}, the checkpoint does not "
                f"(it has {list(source.names)[:3]}...); the strategy belongs to another network"
            )
        if tuple(p.shape) != source.shape(name):
            raise CheckpointError(
                f"parameter {name!r} is {list(source.shape(name))} in the checkpoint but "
                f"{list(p.shape)} in the destination strategy"
            )
        try:
            p.layout.check(p.shape, who=f"parameter {name!r} {list(p.shape)}")
            for r in range(dst.device_num):
                dst.param_piece(name, r)
        except ValueError as e:
            raise CheckpointError(f"the destination strategy does not fit: {e}") from None


def _pieces(
    source: Blocks, dst: CheckpointStrategy, rank: int, keys: Sequence[str]
) -> dict[str, Piece]:
    return {k: dst.entry_piece(k, source.shape(k), rank) for k in keys}


def _write_file(
    source: Blocks, path: Path, pieces: dict[str, Piece], meta: dict[str, str], out: _Out
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = [(k, source.dtype(k), p.local_shape) for k, p in pieces.items()]
    with StreamWriter(path, specs, meta) as writer:
        for key, piece in pieces.items():
            block = source.assemble(key, piece, out.buffers)
            writer.write(key, block)
            out.bar.update(block.numel() * block.element_size())
            del block


@dataclass
class _Out:
    """What every file of one transform shares: the progress bar, the reused buffers."""

    bar: tqdm
    buffers: Buffers | None


def _buffers(source: Blocks, plans: Sequence[Mapping[str, Piece]]) -> Buffers | None:
    """Buffers for the largest destination block and the largest stored block (a `SourceSet`;
    other sources allocate their own)."""
    if not isinstance(source, SourceSet):
        return None
    block = max((source.dtype(k).itemsize * p.numel for ps in plans for k, p in ps.items()),
                default=0)  # fmt: skip
    read = max((source.nbytes(k, f.rank) for f in source.files for k in source.names), default=0)
    return Buffers(block, read)


@contextlib.contextmanager
def _publish(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden path next to `dst` to write into (a file or a folder), renamed to `dst` when
    the block ends without error; on an error (or a kill) `dst` is left as it was."""
    if dst.exists() and not overwrite:
        raise CheckpointError(
            f"{dst} exists; pass overwrite=True to replace it (once the new one is complete), "
            "or choose another destination"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dst)
    tmp = dst.with_name(f".{dst.name}.partial-{_OWNER}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if dst.exists() and _exchange(tmp, dst):  # (atomic: dst is the old or the new, always)
        _remove(tmp)
        return
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:6]}")
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        _remove(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot (the caller then renames the old one away first)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return bool(renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) == 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _remove_stale(dst: Path) -> None:
    """Remove the hidden partial outputs next to `dst` left by killed transforms of this host
    (their process is gone; a live one's, or another host's, are left alone)."""
    for path in dst.parent.glob(f".{glob.escape(dst.name)}.partial-{_OWNER}-*"):
        pid = path.name[len(f".{dst.name}.partial-{_OWNER}-") :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _bar(total: int, what: str, progress: bool | None) -> tqdm:
    show = total >= _PROGRESS_BYTES if progress is None else progress
    return tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not show, leave=False)


def _cut(
    source: Blocks,
    dst: CheckpointStrategy,
    out: Path,
    path_of: Callable[[Path, int], Path],
    *,
    keys: Sequence[str] | None = None,
    meta: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> None:
    """Write `source` cut by `dst`: rank r's file at ``path_of(tmp, r)`` inside the hidden
    `out` being written, published as `out` at the end."""
    _check_fits(source, dst)
    keys = source.names if keys is None else keys
    keep = {k: v for k, v in source.metadata.items() if k in _KEEP and meta is None}
    plans = [_pieces(source, dst, r, keys) for r in range(dst.device_num)]
    total = sum(source.dtype(k).itemsize * p.numel for ps in plans for k, p in ps.items())
    with _publish(out, overwrite) as tmp, _bar(total, "checkpoint", progress) as bar:
        shared = _Out(bar, _buffers(source, plans))
        for r, pieces in enumerate(plans):
            extra = strategy_metadata(dst, r, pieces) if meta is None else dict(meta)
            _write_file(source, path_of(tmp, r), pieces, {"format": "pt"} | keep | extra, shared)


def transform(
    src_dir: PathLike,
    dst_dir: PathLike,
    dst_strategy: object = None,
    *,
    src_strategy: object = None,
    name: str | None = None,
    prefix: str | None = None,
    dst_name: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Re-cut a checkpoint (weights and optimizer state) for another plan or device count.

    Args:
        src_dir: the checkpoint: a folder of ``rank_<r>/`` folders (one per rank), or the
            file(s) of a one-rank job.
        dst_dir: where to write it: ``dst_dir/rank_<r>/<file>`` per rank, or ``dst_dir/<file>``
            for one device. Must not exist unless `overwrite`.
        dst_strategy: the destination's cut: ``parallel_net.parallel_plan``, a parameter or
            operator strategy file, an int N (N ranks each holding everything), a
            `CheckpointStrategy`, or None (one device, whole tensors).
        src_strategy: how the source was cut, only for files that do not record it (written
            by another tool); the same forms as `dst_strategy`.
        name: the file in each rank folder (default: the only one, or the newest of `prefix`).
        prefix: pick the newest ``{prefix}-{epoch}_{step}.safetensors`` in each folder.
        dst_name: the destination files' name (default: the source's).
        overwrite: replace an existing `dst_dir` (only once the new one is complete).
        progress: show a progress bar (default: for checkpoints of 64 MB or more).

    Returns:
        `dst_dir`.

    Example:
        >>> sw.checkpoint.transform("ckpt_8", "ckpt_4", "plan_4.json")  # doctest: +SKIP
        >>> sw.checkpoint.transform("ckpt_4", "ckpt_1")                  # one device
    """
    src_given = None if src_strategy is None else as_strategy(src_strategy)
    source = SourceSet(Path(src_dir), name, prefix, src_given)
    dst = as_strategy(dst_strategy)
    file_name = dst_name or source.files[0].index.path.name

    def path_of(tmp: Path, rank: int) -> Path:
        return checkpoint_dir_for_rank(tmp, rank, dst.device_num) / file_name

    _cut(source, dst, Path(dst_dir), path_of, overwrite=overwrite, progress=progress)
    return Path(dst_dir)


def merge(
    src_dir: PathLike,
    out_file: PathLike,
    *,
    optimizer: bool = False,
    src_strategy: object = None,
    name: str | None = None,
    prefix: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Write the whole tensors of a distributed checkpoint into one safetensors file.

    The file holds the model entries under the network's own names (``optimizer=True``: the
    optimizer state too, for `load_optimizer_state`), so plain PyTorch loads it with
    ``model.load_state_dict(safetensors.torch.load_file(out_file))``.

    Args:
        src_dir: the checkpoint (as for `transform`).
        out_file: the file to write (atomically). Must not exist unless `overwrite`.
        optimizer: include the optimizer state.
        src_strategy, name, prefix, progress: as for `transform`.
        overwrite: replace an existing file.

    Returns:
        `out_file`.

    Example:
        >>> sw.checkpoint.merge("ckpt", "model.safetensors")  # doctest: +SKIP
    """
    src_given = None if src_strategy is None else as_strategy(src_strategy)
    source = SourceSet(Path(src_dir), name, prefix, src_given)
    keys = [k for k in source.names if optimizer or not k.startswith(fmt.OPTIMIZER_PREFIX)]
    kept = _KEEP if optimizer else tuple(k for k in _KEEP if k != fmt.KEY_OPTIMIZER)
    meta = {"format": "pt"} | {k: v for k, v in source.metadata.items() if k in kept}
    single = CheckpointStrategy.single()
    out = Path(out_file)
    _cut(source, single, out, lambda tmp, r: tmp, keys=keys, meta=meta, overwrite=overwrite,
         progress=progress)  # fmt: skip
    return out


def transform_checkpoints(
    src_checkpoints_dir: PathLike,
    dst_checkpoints_dir: PathLike,
    ckpt_prefix: str,
    src_strategy_file: PathLike | None = None,
    dst_strategy_file: PathLike | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """MindSpore's ``transform_checkpoints``: re-cut every rank's checkpoint for another
    strategy, as ``dst_checkpoints_dir/rank_<r>/<ckpt_prefix><r>.safetensors``.

    Args:
        src_checkpoints_dir: the source (``rank_<r>/`` folders, one checkpoint file each).
        dst_checkpoints_dir: the destination folder (created; must not exist).
        ckpt_prefix: the destination files' prefix.
        src_strategy_file: the source's strategy file; None: as the files record it (or
            whole tensors, MindSpore's "not sliced").
        dst_strategy_file: the destination's strategy file; None: one device, whole tensors.
        overwrite: replace an existing destination.

    Example:
        >>> sw.transform_checkpoints("src", "dst", "ckpt_", "a.json", "b.json")  # doctest: +SKIP
    """
    given = None if src_strategy_file is None else as_strategy(src_strategy_file)
    source = SourceSet(Path(src_checkpoints_dir), strategy=given)

    def path_of(tmp: Path, rank: int) -> Path:
        return tmp / f"rank_{rank}" / f"{ckpt_prefix}{rank}.safetensors"

    dst = as_strategy(dst_strategy_file)
    _cut(source, dst, Path(dst_checkpoints_dir), path_of, overwrite=overwrite)


def unified_safetensors(
    src_dir: PathLike,
    src_strategy_file: PathLike | None,
    dst_dir: PathLike,
    *,
    file_name: str = "unified.safetensors",
    overwrite: bool = False,
) -> Path:
    """MindSpore's ``unified_safetensors``: merge a distributed checkpoint's slices into whole
    tensors, written as ``dst_dir/<file_name>`` (model and optimizer entries).

    Args:
        src_dir: the distributed checkpoint (``rank_<r>/`` folders).
        src_strategy_file: its strategy file (None: as the files record it).
        dst_dir: the folder to create.
        file_name: the merged file's name.
        overwrite: replace an existing `dst_dir`.

    Returns:
        The merged file's path.
    """
    given = None if src_strategy_file is None else as_strategy(src_strategy_file)
    source = SourceSet(Path(src_dir), strategy=given)
    single = CheckpointStrategy.single()
    _cut(source, single, Path(dst_dir), lambda tmp, r: tmp / file_name, overwrite=overwrite)
    return Path(dst_dir) / file_name
