"""Re-cut a distributed checkpoint for another plan or device count, or merge it into one file.

- `transform`: the destination's files, written entry by entry (`_cut`). With up to
  `_OPEN_FILES` destination ranks every file is open at once (`_write_entry_major`): each
  entry is assembled once from the stored blocks (`SourceSet.assemble`; whole when the ranks
  hold different pieces of it) and every rank's block is cut from it, so each stored block is
  read once and at most the entry and one block are in memory (two buffers reused for every
  entry, sized for the largest); with more, one file at a time (`_write_file`). Everything is
  written into a hidden folder next to the destination and published at the end
  (`_publish.publish`): a killed transform leaves the destination absent (or, with
  ``overwrite``, the old one), never half written. A destination strategy file that leaves
  out parameters its plan cuts (``only_trainable_params=True``) warns, naming them
  (`_warn_left_out`): they are written whole.
- `merge`: the whole tensors of the model entries in one safetensors file that plain
  ``model.load_state_dict(safetensors.torch.load_file(path))`` loads.
- `Blocks`: what `_cut` reads (a `SourceSet`; `import_dcp` gives a torch DCP checkpoint).
- `file_work`: these file-to-file operations run on plain tensors, in a simulated world too.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from shardwise import communication as comm
from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._describe import strategy_metadata
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._manager import checkpoint_dir_for_rank
from shardwise.checkpoint._pieces import Piece, copy_overlap, whole
from shardwise.checkpoint._publish import publish
from shardwise.checkpoint._sources import Buffers, SourceSet
from shardwise.checkpoint._strategy import CheckpointStrategy, as_strategy
from shardwise.checkpoint._stream import StreamWriter

PathLike = str | os.PathLike[str]
P = ParamSpec("P")
R = TypeVar("R")
_OPEN_FILES = 256  # up to this many destination ranks, every file is written at once
_PROGRESS_BYTES = 64 << 20  # a progress bar for checkpoints from this size on
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


def _check_apart(source: Blocks, out: Path) -> None:
    """The destination must not be, or hold, a file it is made from (publishing it would
    replace the source)."""
    target = out.resolve()
    for path in getattr(source, "paths", ()):
        path = Path(path).resolve()
        if path == target or target in path.parents:
            raise CheckpointError(
                f"the destination {out} holds the checkpoint it is made from ({path}); "
                "write it somewhere else"
            )


def _check_outside_folders(src: Path, source: SourceSet, out: Path) -> None:
    """`merge`'s file must not go into a folder the checkpoint's files were found in (a rank
    folder, or a one-rank job's folder), nor into a ``rank_<r>`` folder beside them: it would
    be read as another file of that rank (other subfolders are not read)."""
    if src.is_file():
        return
    target = out.resolve()
    for path in source.paths:
        folder = path.resolve().parent
        root = folder.parent if re.fullmatch(r"rank_\d+", folder.name) else folder
        ranked = re.fullmatch(r"rank_\d+", target.parent.name) is not None
        if target.parent == folder or (ranked and target.parent.parent == root):
            raise CheckpointError(
                f"merge: the output {out} is inside {folder}, a folder of the checkpoint it is "
                "made from, where it would be read as another checkpoint file; write it "
                f"outside, e.g. {folder.parent / out.name}"
            )


def _pieces(
    source: Blocks, dst: CheckpointStrategy, rank: int, keys: Sequence[str]
) -> dict[str, Piece]:
    return {k: dst.entry_piece(k, source.shape(k), rank) for k in keys}


def _write_file(
    source: Blocks, path: Path, pieces: dict[str, Piece], meta: dict[str, str], out: _Out
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = [(out.name(k), source.dtype(k), p.local_shape) for k, p in pieces.items()]
    with StreamWriter(path, specs, meta) as writer:
        for key, piece in pieces.items():
            block = source.assemble(key, piece, out.buffers)
            writer.write(out.name(key), block)
            out.bar.update(block.numel() * block.element_size())
            del block


@dataclass
class _Out:
    """What every file of one transform shares: the progress bar, the reused buffers."""

    bar: tqdm
    buffers: Buffers | None
    strip: str = ""

    def name(self, key: str) -> str:
        """The name `key` is written under."""
        return key.removeprefix(self.strip) if self.strip else key


def _buffers(source: Blocks, plans: Sequence[Mapping[str, Piece]]) -> Buffers | None:
    """Buffers for the largest destination block and the largest stored block (a `SourceSet`;
    other sources allocate their own)."""
    if not isinstance(source, SourceSet):
        return None
    pieces = max((source.dtype(k).itemsize * p.numel for ps in plans for k, p in ps.items()),
                 default=0)  # fmt: skip
    stored = max((source.nbytes(k, f.rank) for f in source.files for k in f.pieces), default=0)
    whole_entry = max((source.dtype(k).itemsize * math.prod(source.shape(k)) for k in source.names),
                      default=0)  # fmt: skip
    # "block": the entry being assembled (at most whole); "read": a stored block while it is
    # read, then a destination block cut from the entry (never both at once)
    return Buffers(max(pieces, whole_entry), max(stored, pieces))


def _cut_from(entry: torch.Tensor, shape: tuple[int, ...], piece: Piece, out: _Out) -> torch.Tensor:
    """Destination block `piece` of a whole entry: a view where it is one slab of rows, else a
    copy (padding zero) in the reused read buffer."""
    dims = piece.dims
    if (
        all(rs == ((0, n),) for rs, n in zip(dims[1:], shape[1:], strict=True))
        and len(dims[0]) == 1
    ):
        ((a, b),) = dims[0]
        if b <= shape[0]:
            return entry[a:b]
    if out.buffers is None:
        block = torch.zeros(piece.local_shape, dtype=entry.dtype)
    else:
        raw = out.buffers.take("read", piece.numel * entry.element_size())
        raw.numpy().fill(0)
        block = raw.view(entry.dtype).reshape(piece.local_shape)
    copy_overlap(block, piece, entry, whole(shape))
    return block


def _write_entry_major(
    source: Blocks,
    paths: Sequence[Path],
    plans: Sequence[Mapping[str, Piece]],
    metas: Sequence[Mapping[str, str]],
    out: _Out,
) -> None:
    """Every destination file open at once, written entry by entry: each entry assembled once
    (whole, when ranks hold different pieces of it) and every rank's block cut from it."""
    writers: list[StreamWriter] = []
    try:
        for path, pieces, meta in zip(paths, plans, metas, strict=True):
            path.parent.mkdir(parents=True, exist_ok=True)
            specs = [(out.name(k), source.dtype(k), p.local_shape) for k, p in pieces.items()]
            writers.append(StreamWriter(path, specs, meta))
        for key in plans[0] if plans else ():
            groups: dict[Piece, list[int]] = {}
            for r, pieces in enumerate(plans):
                groups.setdefault(pieces[key], []).append(r)
            shape = source.shape(key)
            entry = None
            if len(groups) > 1:
                entry = source.assemble(key, whole(shape), out.buffers)
            for piece, ranks in groups.items():
                block = (
                    source.assemble(key, piece, out.buffers)
                    if entry is None
                    else _cut_from(entry, shape, piece, out)
                )
                for r in ranks:
                    writers[r].write(out.name(key), block)
                    out.bar.update(block.numel() * block.element_size())
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _bar(total: int, what: str, progress: bool | None) -> tqdm:
    # (by default on a terminal only: redirected output gets no carriage-return lines)
    show = total >= _PROGRESS_BYTES and sys.stderr.isatty() if progress is None else progress
    return tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not show, leave=False)


def _warn_left_out(source: Blocks, dst: CheckpointStrategy) -> None:
    """Warn when `dst` (a strategy file saved with ``only_trainable_params=True``) leaves out
    parameters the checkpoint holds and its job cuts: every rank's file gets them whole (as
    MindSpore keeps parameters its destination strategy lacks), which that job cannot load."""
    names = set(source.names)
    missing = [n for n in dst.left_out if n in names]
    if missing and dst.device_num > 1:
        warnings.warn(
            f"{missing} are not in the destination strategy: its file was saved with "
            "only_trainable_params=True, which leaves out the parameters that need no "
            "gradient, though the job's plan cuts them; every rank's file holds them whole, "
            "which that job cannot load after planning. Save the strategy file with "
            "only_trainable_params=False (strategy_ckpt_config={'save_file': ..., "
            "'only_trainable_params': False}, or save_param_strategy_file(path)), or pass "
            "the job's parallel_plan",
            UserWarning,
            stacklevel=5,
        )


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
    strip: str = "",
) -> None:
    """Write `source` cut by `dst`: rank r's file at ``path_of(tmp, r)`` inside the hidden
    `out` being written, published as `out` at the end (`strip`: a prefix taken off every
    name that has it)."""
    recorded = source.recorded_strategy if isinstance(source, SourceSet) else None
    _check_apart(source, out)
    dst = dst.aligned(source.names, recorded)
    _warn_left_out(source, dst)
    _check_fits(source, dst)
    keys = source.names if keys is None else keys
    keep = {k: v for k, v in source.metadata.items() if k in _KEEP and meta is None}
    plans = [_pieces(source, dst, r, keys) for r in range(dst.device_num)]
    total = sum(source.dtype(k).itemsize * p.numel for ps in plans for k, p in ps.items())
    with publish(out, overwrite) as tmp, _bar(total, "checkpoint", progress) as bar:
        shared = _Out(bar, _buffers(source, plans), strip)
        metas = [
            {"format": "pt"}
            | keep
            | (strategy_metadata(dst, r, ps) if meta is None else dict(meta))
            for r, ps in enumerate(plans)
        ]
        paths = [path_of(tmp, r) for r in range(dst.device_num)]
        if dst.device_num <= _OPEN_FILES:  # (each stored block read once)
            _write_entry_major(source, paths, plans, metas, shared)
        else:  # (one file open at a time; a stored block read once per rank needing it)
            for path, pieces, m in zip(paths, plans, metas, strict=True):
                _write_file(source, path, pieces, m, shared)


def file_work(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, a file-to-file operation, run on plain tensors: in a simulated world the same
    as in a real job (its read buffers are not per-rank tensors)."""

    @functools.wraps(fn)
    def plain(*args: P.args, **kwargs: P.kwargs) -> R:
        with comm.plain_tensors():
            return fn(*args, **kwargs)

    return plain


@file_work
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
            `CheckpointStrategy`, or None (one device, whole tensors). An entry it does not
            list is whole in every file; a file saved with ``only_trainable_params=True``
            that leaves out parameters its plan cuts warns (`UserWarning`), naming them.
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
    source = SourceSet(Path(src_dir), name, prefix, src_strategy)
    dst = as_strategy(dst_strategy)
    file_name = dst_name or source.files[0].index.path.name

    def path_of(tmp: Path, rank: int) -> Path:
        return checkpoint_dir_for_rank(tmp, rank, dst.device_num) / file_name

    _cut(source, dst, Path(dst_dir), path_of, overwrite=overwrite, progress=progress)
    return Path(dst_dir)


@file_work
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

    The file holds the model entries under the network's own names (a checkpoint saved
    through an `AutoParallel` wrapper loses the wrapper's ``network.`` prefix), so plain
    PyTorch loads it with ``model.load_state_dict(safetensors.torch.load_file(out_file))``.
    ``optimizer=True`` keeps the optimizer state too, for `load_optimizer_state`, and every
    name as saved.

    Args:
        src_dir: the checkpoint (as for `transform`).
        out_file: the file to write (atomically). Must not exist unless `overwrite`, nor be
            inside a folder of the checkpoint (a ``rank_<r>`` folder: ``ckpt/merged.safetensors``
            is fine, ``ckpt/rank_0/merged.safetensors`` is refused).
        optimizer: include the optimizer state.
        src_strategy, name, prefix, progress: as for `transform`.
        overwrite: replace an existing file.

    Returns:
        `out_file`.

    Example:
        >>> sw.checkpoint.merge("ckpt", "model.safetensors")  # doctest: +SKIP
    """
    source = SourceSet(Path(src_dir), name, prefix, src_strategy)
    _check_outside_folders(Path(src_dir), source, Path(out_file))
    keys = source.names if optimizer else source.model_names
    kept = _KEEP if optimizer else tuple(k for k in _KEEP if k != fmt.KEY_OPTIMIZER)
    meta = {"format": "pt"} | {k: v for k, v in source.metadata.items() if k in kept}
    single = CheckpointStrategy.single()
    out = Path(out_file)
    recorded = source.recorded_strategy
    strip = "" if optimizer or recorded is None else recorded.prefix
    _cut(source, single, out, lambda tmp, r: tmp, keys=keys, meta=meta, overwrite=overwrite,
         progress=progress, strip=strip)  # fmt: skip
    return out
