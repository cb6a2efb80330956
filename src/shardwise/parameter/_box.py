"""Boxes: the block of a contiguous tensor one rank keeps, and how flat ranges land in it.

A `Box` is a per-dimension ``[lo, hi)`` range of a contiguous tensor of ``shape`` (a rank's
block from ``TensorLayout.local_slice``, or the elements a view such as ``weight[0]`` covers).
Chunked generation (``_chunked``) produces the tensor's values as consecutive flat ranges; these
helpers copy the part of each range that falls inside the box into the box's own tensor.

- `Box`, `box_of_index` (a slicer's index -> box), `box_of_view` (a strided view of the whole
  tensor -> the box of the elements it covers), `Box.intersect`, `Box.local_index`.
- `place`: copy the values of flat range ``[start, start + len(chunk))`` that lie in the box.
- `scatter`: the same for scattered flat positions (rejection sampling's redrawn elements).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

Shape = tuple[int, ...]


def contiguous_strides(shape: Shape) -> Shape:
    """The strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


@dataclass(frozen=True)
class Box:
    """Elements ``lo[d] <= i[d] < hi[d]`` of a contiguous tensor of ``shape``."""

    shape: Shape
    lo: Shape
    hi: Shape

    @property
    def local_shape(self) -> Shape:
        """The shape of the box's own tensor."""
        return tuple(h - lo for lo, h in zip(self.lo, self.hi, strict=True))

    @property
    def is_whole(self) -> bool:
        """Whether the box is the whole tensor."""
        return self.lo == (0,) * len(self.shape) and self.hi == self.shape

    @property
    def is_empty(self) -> bool:
        """Whether the box holds no element."""
        return any(h <= lo for lo, h in zip(self.lo, self.hi, strict=True))

    def intersect(self, other: Box) -> Box:
        """The elements in both boxes (possibly empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi, strict=True))
        return Box(self.shape, lo, hi)

    def local_index(self, inner: Box) -> tuple[slice, ...]:
        """Where ``inner`` (a box inside this one) lies in this box's own tensor."""
        return tuple(
            slice(a - lo, b - lo) for a, b, lo in zip(inner.lo, inner.hi, self.lo, strict=True)
        )


def box_of_index(index: Any, shape: Shape) -> Box | None:
    """The box ``full[index]`` selects, if ``index`` is a tuple of step-1 slices (or one slice);
    None for anything else (integers, steps, tensors, Ellipsis)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape) or not all(isinstance(item, slice) for item in items):
        return None
    lo, hi = [0] * len(shape), list(shape)
    for d, item in enumerate(items):
        start, stop, step = item.indices(shape[d])
        if step != 1:
            return None
        lo[d], hi[d] = start, max(start, stop)
    return Box(shape, tuple(lo), tuple(hi))


def box_of_view(size: Shape, stride: Shape, offset: int, shape: Shape) -> Box | None:
    """The box of the elements that ``as_strided(full, size, stride, offset)`` covers, for a
    contiguous ``full`` of ``shape``; None unless every view dimension walks one tensor
    dimension with step 1 (a view such as ``w[0]``, ``w[:, 2:5]`` or ``w.t()``)."""
    strides = contiguous_strides(shape)
    numel = math.prod(shape)
    if 0 in size:
        return Box(shape, (0,) * len(shape), (0,) * len(shape))
    if not 0 <= offset < numel:
        return None
    lo = [(offset // s) % n for s, n in zip(strides, shape, strict=True)]
    hi = [start + 1 for start in lo]
    used: set[int] = set()
    for n, st in zip(size, stride, strict=True):
        if n == 1:
            continue
        dims = [d for d in range(len(shape)) if strides[d] == st and shape[d] > 1]
        if not dims or dims[0] in used or lo[dims[0]] + n > shape[dims[0]]:
            return None
        used.add(dims[0])
        hi[dims[0]] = lo[dims[0]] + n
    box = Box(shape, tuple(lo), tuple(hi))
    return box if math.prod(box.local_shape) == math.prod(size) else None


Piece = tuple[Shape, int, int]
"""``(prefix, lo, hi)``: indices ``prefix`` on the first dims, ``[lo, hi)`` on the next one,
everything on the rest."""


def _pieces(shape: Shape, dim: int, prefix: Shape, start: int, stop: int) -> Iterator[Piece]:
    """Pieces covering flat ``[start, stop)`` of the sub-tensor at ``prefix``."""
    if start >= stop:
        return
    inner = math.prod(shape[dim + 1 :])
    if start % inner == 0 and stop % inner == 0:
        yield prefix, start // inner, stop // inner
        return
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        yield from _pieces(
            shape, dim + 1, (*prefix, first), start % inner, start % inner + (stop - start)
        )
        return
    if start % inner:
        yield from _pieces(shape, dim + 1, (*prefix, first), start % inner, inner)
        first += 1
    whole_end = stop // inner
    if first < whole_end:
        yield prefix, first, whole_end
    if stop % inner:
        yield from _pieces(shape, dim + 1, (*prefix, whole_end), 0, stop % inner)


def place(chunk: torch.Tensor, start: int, box: Box, out: torch.Tensor) -> None:
    """Copy the elements of flat range ``[start, start + chunk.numel())`` of the full tensor
    (values ``chunk``, 1-D) that lie in ``box`` into ``out`` (the box's own tensor)."""
    shape = box.shape
    strides = contiguous_strides(shape)
    for prefix, lo, hi in _pieces(shape, 0, (), start, start + chunk.numel()):
        d = len(prefix)
        if any(not box.lo[i] <= p < box.hi[i] for i, p in enumerate(prefix)):
            continue
        a, b = max(lo, box.lo[d]), min(hi, box.hi[d])
        if a >= b:
            continue
        inner = strides[d]
        first = sum(p * s for p, s in zip(prefix, strides, strict=False)) + a * inner - start
        rest = tuple(slice(box.lo[j], box.hi[j]) for j in range(d + 1, len(shape)))
        src = chunk[first : first + (b - a) * inner].view(b - a, *shape[d + 1 :])
        at = tuple(p - box.lo[i] for i, p in enumerate(prefix))
        dst: tuple[int | slice, ...] = (*at, slice(a - box.lo[d], b - box.lo[d]))
        out[dst].copy_(src[(slice(None), *rest)])


def scatter(flat: torch.Tensor, values: torch.Tensor, box: Box, out: torch.Tensor) -> None:
    """Write ``values`` at the flat positions ``flat`` (integers, of the full tensor) that lie
    in ``box`` into ``out`` (the box's own contiguous tensor)."""
    if flat.numel() == 0:
        return
    inside = torch.ones_like(flat, dtype=torch.bool)
    local = torch.zeros_like(flat, dtype=torch.int64)
    rest, strides = flat, contiguous_strides(box.local_shape)
    for d in range(len(box.shape) - 1, -1, -1):
        index = rest % box.shape[d]
        rest = rest // box.shape[d]
        inside &= (index >= box.lo[d]) & (index < box.hi[d])
        local += (index - box.lo[d]) * strides[d]
    out.view(-1)[local[inside]] = values[inside]
