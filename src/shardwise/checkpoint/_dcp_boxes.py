"""A stored block as the rectangular chunks torch's distributed checkpoint (DCP) speaks in.

DCP describes every stored part of a tensor as one rectangle: a global offset and a size per
dim. A shardwise `Piece` may hold several ranges in a dim (a strided layout) and ranges past a
dim's end (optimizer parallel's padding), so it is one rectangle per combination of its ranges,
padding cut off.

- `Box`: one rectangle: its global offsets and lengths, and where it starts in the block.
- `boxes`: the rectangles of a piece (padding dropped, empty ones skipped).
- `Box.view`: the rectangle's part of the block tensor (a view).
- `Box.overlap`: the part of a rectangle that another (a DCP chunk) holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.checkpoint._pieces import Piece


@dataclass(frozen=True)
class Box:
    """A rectangle of a global tensor held in a stored block.

    Attributes:
        offsets: its global start per dim.
        lengths: its size per dim.
        local: its start per dim within the block.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    local: tuple[int, ...]

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """The rectangle's elements of `block` (a view)."""
        out = block
        for dim, (start, length) in enumerate(zip(self.local, self.lengths, strict=True)):
            out = out.narrow(dim, start, length)
        return out

    def overlap(self, offsets: Sequence[int], sizes: Sequence[int]) -> Box | None:
        """The part of this rectangle inside the rectangle at `offsets` of `sizes` (its
        `local` is the start within this block), or None when they share nothing."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, offsets, strict=True))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.lengths, offsets, sizes, strict=True)
        )
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        local = tuple(
            loc + lo_ - a for loc, lo_, a in zip(self.local, lo, self.offsets, strict=True)
        )
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)), local)


def boxes(piece: Piece) -> list[Box]:
    """The rectangles of `piece`: one per combination of its ranges, padding cut off.

    Args:
        piece: a stored block's part of its global tensor.

    Returns:
        The rectangles, in the block's order (a 0-dim tensor: one empty rectangle).

    Example:
        >>> p = Piece((6, 2), (((0, 1), (3, 4)), ((0, 2),)))  # rows 0 and 3
        >>> [b.offsets for b in boxes(p)]
        [(0, 0), (3, 0)]
    """
    per_dim = []
    for ranges, size in zip(piece.dims, piece.shape, strict=True):
        options, position = [], 0
        for start, stop in ranges:
            if start < min(stop, size):
                options.append((start, min(stop, size) - start, position))
            position += stop - start
        per_dim.append(options)
    return [
        Box(tuple(o[0] for o in combo), tuple(o[1] for o in combo), tuple(o[2] for o in combo))
        for combo in itertools.product(*per_dim)
    ]
