"""Which part of a global tensor a checkpoint entry holds: a `Piece`, and copying between pieces.

A rank's checkpoint stores, for each entry, its *piece* of the global tensor: per tensor dim,
the global index ranges it holds, in the order its block stores them (one range for a plain
split, one per group for a strided one; ranges past the dim's end are padding). Every layout a
plan gives a parameter, and the dim-0 cut of optimizer parallel on top, is such a piece, so any
checkpoint can be re-cut into any other by copying overlaps.

- `Piece`: global shape + ranges; `whole`, `local_shape`, `size` (elements that are not
  padding), JSON with `to_json` / `piece_of`.
- `layout_piece`: global rank r's block of a `TensorLayout`.
- `cut_rows`: a block's dim-0 part at a shard group position (optimizer parallel), optionally
  padded to equal parts.
- `copy_overlap`: copy the elements two pieces share, from one local tensor into another
  (views where the shared part is one slice per dim, index copies for strided dims).
- `check_covers`: the distinct pieces of one tensor tile it (no gap, no overlap).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.checkpoint._errors import CheckpointError
from shardwise.checkpoint._layouts import checkpoint_folder
from shardwise.layout import TensorLayout

Ranges = tuple[tuple[int, int], ...]
_PAIRWISE = 64  # up to this many distinct pieces, `check_covers` also checks them pairwise


@dataclass(frozen=True)
class Piece:
    """A part of a global tensor of `shape`: per dim, the (start, stop) ranges held, in order.

    Example:
        >>> p = Piece((4, 6), (((2, 4),), ((0, 6),)))     # rows 2-3, every column
        >>> p.local_shape, p.is_whole
        ((2, 6), False)
    """

    shape: tuple[int, ...]
    dims: tuple[Ranges, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the stored block (padding included)."""
        return tuple(sum(b - a for a, b in rs) for rs in self.dims)

    @property
    def numel(self) -> int:
        """Elements of the stored block (padding included)."""
        return math.prod(self.local_shape)

    @property
    def is_whole(self) -> bool:
        """Whether the piece is the whole tensor, unpadded."""
        return all(rs == ((0, n),) for rs, n in zip(self.dims, self.shape, strict=True))

    @property
    def size(self) -> int:
        """Elements of the global tensor it holds (padding not counted)."""
        return math.prod(
            sum(max(0, min(b, n) - a) for a, b in rs)
            for rs, n in zip(self.dims, self.shape, strict=True)
        )

    def indices(self, dim: int) -> np.ndarray:
        """The global index of each position along `dim` (>= the dim's size: padding)."""
        parts = [np.arange(a, b, dtype=np.int64) for a, b in self.dims[dim]]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data (`piece_of` reads it back)."""
        return {"shape": list(self.shape), "dims": [[list(r) for r in rs] for rs in self.dims]}

    def __str__(self) -> str:
        def one(rs: Ranges) -> str:
            return "+".join(f"{a}:{b}" for a, b in rs)

        return f"[{', '.join(one(rs) for rs in self.dims)}] of {list(self.shape)}"


def whole(shape: Sequence[int]) -> Piece:
    """The piece that is the whole tensor of `shape`."""
    return Piece(tuple(shape), tuple(((0, n),) for n in shape))


def piece_of(data: Any) -> Piece:
    """The piece `Piece.to_json` wrote (`CheckpointError` when malformed)."""
    try:
        shape = tuple(int(n) for n in data["shape"])
        dims = tuple(tuple((int(a), int(b)) for a, b in rs) for rs in data["dims"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"malformed piece {data!r} ({e})") from None
    if len(dims) != len(shape) or any(a < 0 or b < a for rs in dims for a, b in rs):
        raise CheckpointError(f"malformed piece {data!r}")
    return Piece(shape, dims)


def rank_file_hint(data: object, where: object, args: str = "", then: str = "") -> str:
    """Why one rank's file of a distributed checkpoint (`data`: an entry's recorded piece,
    `where`: the file) cannot fill a whole tensor, and the fix: ``load_distributed`` on its
    checkpoint folder (`args`: further arguments, ``", optimizer"``; `then`: words after it);
    "" when `data` records no piece."""
    if not isinstance(data, dict):
        return ""
    try:
        held = str(piece_of(data))  # ([4:6, 0:6] of [8, 6])
    except CheckpointError:
        held = f"{data.get('dims')} of {data.get('shape')}"
    folder = str(checkpoint_folder(Path(str(where))) or Path(str(where)).parent.parent)
    return (
        f"; the file is one rank's part of a distributed checkpoint (it holds {held}): load the "
        f"checkpoint folder with sw.checkpoint.load_distributed(net, {folder!r}{args}){then}"
    )


def layout_piece(layout: TensorLayout, rank: int, shape: Sequence[int]) -> Piece:
    """Global `rank`'s block of a tensor of global `shape` stored in `layout`."""
    ranges = layout.local_ranges(rank, tuple(shape))
    return Piece(tuple(shape), tuple(tuple((r.start, r.stop) for r in rs) for rs in ranges))


def _take(ranges: Ranges, start: int, stop: int, size: int) -> Ranges:
    """Positions [start, stop) of the index list `ranges` as ranges (past its end: padding
    that continues from `size`)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in (*ranges, (max(size, ranges[-1][1] if ranges else 0), 1 << 62)):
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
        if pos >= stop:
            break
    return tuple(out)


def cut_rows(piece: Piece, position: int, parts: int, pad: bool = False) -> Piece:
    """Part `position` of `parts` of the piece's dim 0 (optimizer parallel's shard).

    Args:
        piece: the op-level block.
        position: this rank's index in its shard group.
        parts: the shard group's size.
        pad: cut ``ceil(rows / parts)`` rows each, the last part padded past the end; else
            the rows must divide.

    Returns:
        The shard's piece.
    """
    rows = piece.local_shape[0]
    if not pad and rows % parts:
        raise CheckpointError(f"{rows} rows of {piece} do not divide into {parts} shards")
    each = -(-rows // parts)
    ranges = _take(piece.dims[0], position * each, (position + 1) * each, piece.shape[0])
    return Piece(piece.shape, (ranges, *piece.dims[1:]))


def _as_slice(positions: np.ndarray) -> slice | None:
    n = len(positions)
    if (
        n
        and int(positions[-1]) - int(positions[0]) == n - 1
        and bool(np.all(np.diff(positions) == 1))
    ):
        return slice(int(positions[0]), int(positions[0]) + n)
    return None


def _matches(dst: Piece, src: Piece, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions along `dim` in `dst` and in `src` holding the same (unpadded) global index."""
    size = dst.shape[dim]
    s_idx, d_idx = src.indices(dim), dst.indices(dim)
    where = np.full(size, -1, np.int64)
    ok = s_idx < size
    where[s_idx[ok]] = np.nonzero(ok)[0]
    pos = np.full(len(d_idx), -1, np.int64)
    ok = d_idx < size
    pos[ok] = where[d_idx[ok]]
    t = np.nonzero(pos >= 0)[0]
    return t, pos[t]


def overlaps(dst: Piece, src: Piece) -> bool:
    """Whether the two pieces share any element."""
    return all(len(_matches(dst, src, d)[0]) for d in range(len(dst.shape)))


def copy_overlap(dst: torch.Tensor, dst_piece: Piece, src: torch.Tensor, src_piece: Piece) -> int:
    """Copy the elements `src` (holding `src_piece`) shares with `dst` (holding `dst_piece`).

    Returns:
        The number of elements copied.
    """
    if tuple(dst.shape) != dst_piece.local_shape or tuple(src.shape) != src_piece.local_shape:
        raise CheckpointError(
            f"a stored block of shape {list(src.shape)} / {list(dst.shape)} does not match its "
            f"piece {src_piece} / {dst_piece}"
        )
    pairs = [_matches(dst_piece, src_piece, d) for d in range(dst.dim())]
    if any(len(t) == 0 for t, _ in pairs):
        return 0
    d_view, s_view, lists = dst, src, []
    for d, (t, s) in enumerate(pairs):
        ts, ss = _as_slice(t), _as_slice(s)
        if ts is not None and ss is not None:
            d_view = d_view.narrow(d, ts.start, ts.stop - ts.start)
            s_view = s_view.narrow(d, ss.start, ss.stop - ss.start)
        else:
            lists.append(d)
    for d in lists:
        s_view = s_view.index_select(d, torch.from_numpy(pairs[d][1]))
    if not lists:
        _copy(d_view, s_view)
    elif len(lists) == 1:
        d_view.index_copy_(lists[0], torch.from_numpy(pairs[lists[0]][0]), s_view)
    else:  # several strided dims: every dim as a broadcast index
        index = []
        for d in range(dst.dim()):
            shape = [1] * dst.dim()
            shape[d] = -1
            pos = pairs[d][0] if d in lists else np.arange(d_view.shape[d])
            index.append(torch.from_numpy(np.asarray(pos)).reshape(shape))
        d_view.index_put_(tuple(index), s_view)
    return math.prod(len(t) for t, _ in pairs)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in this thread (numpy on same-size integer views: the copy is bound
    by memory, and torch's thread pool costs a scheduler tick per call on a busy host)."""
    as_int = _SAME_SIZE_INT.get(dst.element_size())
    if as_int is None or dst.dtype != src.dtype:
        dst.copy_(src)
        return
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


def check_covers(name: str, shape: Sequence[int], pieces: Iterable[Piece]) -> None:
    """Raise `CheckpointError` unless the distinct `pieces` tile the tensor of `shape`."""
    distinct = set(pieces)
    total, want = sum(p.size for p in distinct), math.prod(shape)
    if total == want and len(distinct) <= _PAIRWISE:  # (equal counts: also no overlap, no gap)
        ordered = sorted(distinct, key=str)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                if overlaps(a, b):
                    raise CheckpointError(
                        f"{name!r}: the rank files' pieces {a} and {b} overlap, so others leave "
                        "a gap; the recorded cut (or src_strategy) does not fit this checkpoint"
                    )
    if total != want:
        raise CheckpointError(
            f"{name!r}: the rank files hold {total} of its {want} elements (global shape "
            f"{list(shape)}); pieces {sorted(str(p) for p in distinct)[:4]} do not tile it"
        )
