"""A distributed checkpoint on disk: one file per rank, found, checked and read piece by piece.

`SourceSet` opens a checkpoint directory (``rank_<r>/<file>`` per rank, MindSpore's layout and
`CheckpointManager`'s, or ``<r>/rank_<r>/<file>``: `rank_folders`) or a single file, reads every
file's header only, and checks that the files make one checkpoint: every rank of the recorded
job present, the same model entries with the same global shapes and dtypes on every rank, each
tensor's pieces tiling it, and files holding the same piece holding the same values (but the
per-rank buffers of a data_parallel job's files, read from rank 0's: `_replicas`). An optimizer
entry may be in some files only (data_parallel with hsdp keeps each parameter's state, whole,
in its owner rank's file): the files holding it must tile it, and `metadata`
gives one optimizer description of every file's state. Tensors are read only when asked:

- `SourceSet.read`: one rank's stored block of an entry (checksum verified); `SourceSet.verify`
  checks the blocks of some entries up front.
- `SourceSet.assemble`: any piece of an entry (the whole tensor, or another plan's block) from
  the blocks that overlap it, each read and dropped in turn (into reused `Buffers` when given).
- `find_files`: the file of each rank (`name`, the newest of `prefix`, or the only one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import _format as fmt
from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._layouts import LAYOUTS, rank_folders
from shardwise.checkpoint._manager import parse_checkpoint_filename
from shardwise.checkpoint._optimizer import merged_description
from shardwise.checkpoint._pieces import (
    Piece,
    check_covers,
    copy_overlap,
    overlaps,
    piece_of,
    whole,
)
from shardwise.checkpoint._replicas import per_rank_buffer, replicas_fix
from shardwise.checkpoint._strategy import CheckpointStrategy, as_strategy
from shardwise.checkpoint._stream import FileIndex, read_entry, read_index

_SAME_ON_EVERY_RANK = (fmt.KEY_DEVICE_NUM, fmt.KEY_STEP, fmt.KEY_EPOCH, fmt.KEY_STRATEGY)


def _mismatch(key: str, path_a: Path, a: str | None, path_b: Path, b: str | None) -> str:
    if key == fmt.KEY_STRATEGY and a and b:
        return f"{path_b} records another cut ({key}) than {path_a}"
    a_text, b_text = ("nothing" if v is None else repr(v[:60]) for v in (a, b))
    return f"{path_b} records {key} = {b_text} but {path_a} records {a_text}"


def _newest(directory: Path, prefix: str | None) -> Path:
    files = sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))
    if prefix is not None:
        dated = [(parse_checkpoint_filename(p.name, prefix), p) for p in files]
        ordered = sorted((d, p) for d, p in dated if d is not None)
        if not ordered:
            raise CheckpointError(f"{directory}: no checkpoint file of prefix {prefix!r}")
        return ordered[-1][1]
    if len(files) != 1:
        raise CheckpointError(
            f"{directory}: {len(files)} checkpoint files "
            f"({', '.join(p.name for p in files[:4])}); pass the file name or its prefix"
        )
    return files[0]


def find_files(src: Path, name: str | None = None, prefix: str | None = None) -> dict[int, Path]:
    """Each rank's file in `src` (a file: rank 0 only; a directory of ``rank_<r>`` folders, or
    of ``<r>/rank_<r>`` folders: `rank_folders`; a directory holding the files of a one-rank
    job)."""
    if src.is_file():
        return {0: src}
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {src}")
    folders = rank_folders(src) or {0: src}
    out = {}
    for r, folder in sorted(folders.items()):
        if name is not None:
            out[r] = folder / name
            if not out[r].is_file():
                raise CheckpointError(f"missing rank file: {out[r]}")
        else:
            out[r] = _newest(folder, prefix)
    return out


@dataclass(frozen=True)
class RankFile:
    """One rank's file: its header and the piece each entry holds."""

    rank: int
    index: FileIndex
    pieces: Mapping[str, Piece]


def _rank_file(rank: int, path: Path, given: CheckpointStrategy | None) -> RankFile:
    index = read_index(path)
    recorded = fmt.parse_int(path, index.metadata, fmt.KEY_RANK)
    if recorded is not None and recorded != rank:
        raise CheckpointError(
            f"{path}: the file records rank {recorded}, it is in rank {rank}'s place"
        )
    stored = fmt.parse_json(path, index.metadata, fmt.KEY_PIECES) or {}
    pieces = {}
    for key, entry in index.entries.items():
        if key in stored:
            pieces[key] = piece_of(stored[key])
        elif given is not None:  # (a file that does not describe itself: the strategy file)
            found = given.stored_piece(key, entry.shape, rank)
            if found is None:
                raise CheckpointError(
                    f"{path}: {key!r} stores shape {list(entry.shape)}, not the block rank "
                    f"{rank} holds under the given strategy; the strategy does not fit this "
                    "checkpoint"
                )
            pieces[key] = found
        else:
            pieces[key] = whole(entry.shape)
        if pieces[key].local_shape != entry.shape:
            raise CheckpointError(
                f"{path}: {key!r} stores shape {list(entry.shape)}, but its piece {pieces[key]} "
                "has another; the strategy does not fit this checkpoint"
            )
    return RankFile(rank, index, pieces)


class Buffers:
    """Byte buffers reused from one `SourceSet.assemble` call to the next (the block being
    assembled, the stored block being read), each allocated once at the size it is created
    with: memory stays at those two blocks however many entries pass through.

    Args:
        block: the largest block to assemble, in bytes.
        read: the largest stored block to read, in bytes.
    """

    def __init__(self, block: int, read: int) -> None:
        self.sizes = {"block": block, "read": read}
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, slot: str, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of buffer `slot` ("block" or "read")."""
        if slot not in self.buffers:
            self.buffers[slot] = torch.empty(self.sizes[slot], dtype=torch.uint8)
        if nbytes > self.sizes[slot]:
            raise ValueError(f"{nbytes} bytes do not fit the {slot} buffer of {self.sizes[slot]}")
        return self.buffers[slot][:nbytes]


class SourceSet:
    """A checkpoint of one or more rank files, checked to be whole and consistent.

    Args:
        src: a checkpoint directory (``rank_<r>/`` folders, or the files of one rank) or file.
        name: the file name in every rank folder (default: the only one, or the newest of
            `prefix`).
        prefix: pick the newest ``{prefix}-{epoch}_{step}.safetensors``.
        strategy: how the files were cut, for files that do not record it (MindSpore's
            ``src_strategy_file``): any form `as_strategy` takes, or None.

    Example:
        >>> src = SourceSet(Path("ckpt"))  # doctest: +SKIP
        >>> full = src.assemble("fc.weight", whole(src.shape("fc.weight")))  # doctest: +SKIP
    """

    def __init__(
        self,
        src: str | Path,
        name: str | None = None,
        prefix: str | None = None,
        strategy: object = None,
    ) -> None:
        given = None if strategy is None else as_strategy(strategy)
        self._given = given
        paths = find_files(Path(src), name, prefix)
        self.files = [_rank_file(r, p, given) for r, p in paths.items()]
        self._verified: set[tuple[int, str]] = set()  # (rank, key) blocks checksummed once
        first = self.files[0]
        recorded = fmt.parse_int(first.index.path, first.index.metadata, fmt.KEY_DEVICE_NUM)
        self.device_num = recorded or (given.device_num if given else len(self.files))
        missing = sorted(set(range(self.device_num)) - set(paths))
        if missing or len(paths) != self.device_num:
            extra = sorted(set(paths) - set(range(self.device_num)))
            problems = []
            if missing:
                problems.append(
                    f"the files of {', '.join(f'rank_{r}' for r in missing)} are missing"
                )
            if extra:
                problems.append(f"folders {', '.join(f'rank_{r}' for r in extra)} are extra")
            raise CheckpointError(
                f"{src}: the checkpoint is of {self.device_num} ranks but {'; '.join(problems)}; "
                f"it needs the folders rank_0 ... rank_{self.device_num - 1}, one file each, "
                f"laid out as {LAYOUTS}: put every rank's file of this save there"
            )
        self._check_same_save()
        self._check_entries()

    def _check_same_save(self) -> None:
        """Every file records the same job, strategy, step and epoch (rank files of two
        checkpoints mixed in one folder are refused)."""
        first = self.files[0]
        for f in self.files[1:]:
            for key in _SAME_ON_EVERY_RANK:
                a, b = first.index.metadata.get(key), f.index.metadata.get(key)
                if a != b:
                    raise CheckpointError(
                        f"{_mismatch(key, first.index.path, a, f.index.path, b)}: the rank files "
                        "are of different checkpoints; put the files of one save together"
                    )

    def _check_entries(self) -> None:
        """Every file holds the same model entries; an optimizer entry may be in some files
        only (data_parallel with hsdp keeps a parameter's state on its owner rank), the pieces
        of the files holding it then tiling it. Each entry has one global shape and dtype."""
        found = []
        for f in self.files:
            d = fmt.parse_json(f.index.path, f.index.metadata, fmt.KEY_OPTIMIZER)
            lost = sorted(set(d.get("tensors", ())) - set(f.index.entries)) if d else []
            if lost:
                raise CheckpointError(
                    f"{f.index.path}: its optimizer description lists entry {lost[0]!r}, which "
                    "the file does not hold; the file is damaged: save it again"
                )
            found.append((f.index.path, d))
        self.description = merged_description(found)
        meta = self.files[0].index.metadata
        if self.description is not None and self.description != found[0][1]:
            meta = {**meta, fmt.KEY_OPTIMIZER: json.dumps(self.description)}
        self._metadata: Mapping[str, str] = meta
        self._holder: dict[str, RankFile] = {}
        for f in self.files:
            for key in f.index.entries:
                self._holder.setdefault(key, f)
        self.names = list(self._holder)
        described = self.description["tensors"] if self.description else ()
        self.optimizer_keys = frozenset(described) & set(self.names)
        for key in self.names:
            self._check_entry(key)
            self._check_replicas(key)

    def _holding(self, key: str) -> list[RankFile]:
        return [f for f in self.files if key in f.pieces]

    def _check_entry(self, key: str) -> None:
        """`key` has one global shape and dtype and the pieces of the files holding it tile
        it; a model entry is in every file, an optimizer entry may be in some only."""
        first, holding = self._holder[key], self._holding(key)
        for f in holding:
            a, b = first.pieces[key], f.pieces[key]
            da, db = first.index.entries[key].dtype, f.index.entries[key].dtype
            if a.shape != b.shape or da != db:
                raise CheckpointError(
                    f"{key!r} is {da}{list(a.shape)} in {first.index.path} but "
                    f"{db}{list(b.shape)} in {f.index.path}"
                )
        lacking = [f.index.path for f in self.files if key not in f.pieces]
        if lacking and key not in self.optimizer_keys:
            raise CheckpointError(
                f"{lacking[0]}: entry {key!r} is in {first.index.path} but not in this file; "
                "the files are of different checkpoints"
            )
        try:
            check_covers(key, self.shape(key), [f.pieces[key] for f in holding])
        except CheckpointError as e:
            if not lacking:
                raise
            raise CheckpointError(
                f"optimizer entry {key!r} is in {', '.join(str(f.index.path) for f in holding)} "
                f"only, not in {', '.join(map(str, lacking))}, and those files do not hold all "
                f"of it ({e}); the checkpoint is incomplete: put back every rank's file of "
                "that save (each rank saves the state it holds)"
            ) from None

    def _check_replicas(self, key: str) -> None:
        """Files holding the same piece of `key` must hold the same values (their recorded
        checksums agree): rank files that do not record their cut are taken as whole, and
        blocks of a cut tensor saved that way would otherwise pass for one whole tensor. A
        buffer of whole-network files (`per_rank_buffer`) may differ: rank 0's is read."""
        seen: dict[Piece, tuple[int, RankFile]] = {}
        for f in self._holding(key):
            crc = f.index.checksums.get(key)
            if crc is None:
                continue
            first = seen.setdefault(f.pieces[key], (crc, f))
            if first[0] != crc and not self.per_rank_buffer(key):
                raise CheckpointError(
                    f"{key!r} holds different values in {first[1].index.path} and "
                    f"{f.index.path}, which both record it as {f.pieces[key]}; "
                    + replicas_fix(
                        key, self._given, fmt.KEY_STRATEGY in self.files[0].index.metadata
                    )
                )

    def per_rank_buffer(self, key: str) -> bool:
        """Whether `key` is a buffer each rank may hold its own values of (`holders` then reads
        rank 0's): `_replicas.per_rank_buffer`."""
        recorded = fmt.KEY_STRATEGY in self.files[0].index.metadata
        cut = self._given is not None or recorded
        return not cut and per_rank_buffer(key, self.description, self.optimizer_keys)

    @property
    def paths(self) -> list[Path]:
        """The rank files, in rank order."""
        return [f.index.path for f in self.files]

    def is_optimizer(self, key: str) -> bool:
        """Whether entry `key` is optimizer state (listed by the file's optimizer description),
        not a model entry."""
        return key in self.optimizer_keys

    @property
    def model_names(self) -> list[str]:
        """The model entries (parameters and buffers), in file order."""
        return [k for k in self.names if k not in self.optimizer_keys]

    @property
    def metadata(self) -> Mapping[str, str]:
        """Rank 0's metadata (step, epoch, ...), with the optimizer description of every
        file's state (`merged_description`)."""
        return self._metadata

    @property
    def recorded_strategy(self) -> CheckpointStrategy | None:
        """The strategy the files record (None for files that do not describe themselves)."""
        data = fmt.parse_json(self.files[0].index.path, self.metadata, fmt.KEY_STRATEGY)
        return None if data is None else CheckpointStrategy.from_json(data, "checkpoint")

    def shape(self, key: str) -> tuple[int, ...]:
        """Entry `key`'s global shape."""
        return self._holder[key].pieces[key].shape

    def dtype(self, key: str) -> torch.dtype:
        """Entry `key`'s dtype."""
        return self._holder[key].index.entries[key].dtype

    def read(self, key: str, rank: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rank `rank`'s stored block of `key` (checksum verified the first time it is read;
        `into`: a byte buffer to read into, as `read_entry`)."""
        verify = (rank, key) not in self._verified
        block = read_entry(self.files[rank].index, key, verify=verify, into=into)
        self._verified.add((rank, key))
        return block

    def verify(self, keys: list[str]) -> None:
        """Checksum every stored block of `keys` that an assembly would read (one at a time),
        so that a corrupt file is found before anything is loaded."""
        for key in keys:
            for rank in self.holders(key).values():
                if (rank, key) not in self._verified:
                    self.read(key, rank)

    def holders(self, key: str) -> dict[Piece, int]:
        """Each distinct stored piece of `key`, with the first rank holding it."""
        out: dict[Piece, int] = {}
        for f in self._holding(key):
            out.setdefault(f.pieces[key], f.rank)
        return out

    def assemble(self, key: str, target: Piece, buffers: Buffers | None = None) -> torch.Tensor:
        """The block `target` of entry `key`, from the stored blocks overlapping it (padding
        positions are zero): a new tensor, or a view of `buffers` valid until the next call."""
        dtype = self.dtype(key)
        for piece, rank in self.holders(key).items():
            if target == piece:
                into = None if buffers is None else buffers.take("block", self.nbytes(key, rank))
                return self.read(key, rank, into)
        if buffers is None:
            out = torch.zeros(target.local_shape, dtype=dtype)
        else:
            raw = buffers.take("block", target.numel * dtype.itemsize)
            raw.numpy().fill(0)  # (in this thread, as `copy_overlap` copies)
            out = raw.view(dtype).reshape(target.local_shape)
        for piece, rank in self.holders(key).items():
            if overlaps(target, piece):
                into = None if buffers is None else buffers.take("read", self.nbytes(key, rank))
                copy_overlap(out, target, self.read(key, rank, into), piece)
        return out

    def nbytes(self, key: str, rank: int) -> int:
        """The bytes of rank `rank`'s stored block of `key`."""
        e = self.files[rank].index.entries[key]
        return e.stop - e.start

    def describe(self) -> dict[str, Any]:
        """A short description: device count, files and entries (for messages)."""
        return {"device_num": self.device_num, "files": [str(f.index.path) for f in self.files]}
