"""Random fills of a whole tensor generated chunk by chunk, keeping only one block.

Each fill draws from the generator exactly as the one call on the whole (contiguous) tensor
would: torch 2.13's CPU generator (mt19937) serves ``uniform_`` element by element in order (one
32-bit draw per element, two for float64), so any split of the flat range into consecutive
chunks draws the same numbers; ``normal_`` on a contiguous tensor of 16 or more elements first
draws one uniform per element, turns each aligned group of 16 into 16 normals (Box-Muller), and,
when the size is not a multiple of 16, redraws the last 16 elements. A chunk that starts at a
multiple of 16 and holds at least 16 elements therefore runs exactly the whole call's code on
its elements, so chunks are multiples of 16 with the remainder joined to the last one
(`chunk_bounds`). ``trunc_normal_`` (``torch.nn.init``'s, when the interval holds more than 30%
of the mass) is a normal draw of the whole tensor, then whole redraws while any element is out
of bounds: its chunked form keeps the flat positions still out of bounds between rounds.

- `Draw`: ``uniform_`` / ``normal_`` with its parameters and generator.
- `TruncNormal`: ``trunc_normal_``'s rejection sampling.
- `chunk_bounds`: the chunk boundaries of a flat range.
- `proven`: whether chunking a kind of fill is checked identical on this build (a one-off
  comparison on a small tensor, cached per fill kind and dtype); where it is not, the caller
  generates the tensor whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardwise.parameter._box import Box, place, scatter

ALIGN = 16
"""``normal_`` turns groups of 16 uniforms into normals: chunks start at multiples of this."""


def _step(chunk: int) -> int:
    return max(ALIGN, chunk // ALIGN * ALIGN)


def chunk_bounds(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[start, stop)`` covering ``[0, numel)``: ``chunk`` elements each (rounded
    down to a multiple of `ALIGN`), the remainder joined to the last one when it is shorter
    than `ALIGN` (so every chunk but a lone one holds at least `ALIGN` elements)."""
    step = _step(chunk)
    start = 0
    while start < numel:
        stop = start + step
        if numel - stop < ALIGN:
            stop = numel
        yield start, stop
        start = stop


def _scratch(numel: int, chunk: int, like: torch.Tensor) -> torch.Tensor:
    """A buffer for the longest chunk (`chunk_bounds` adds less than `ALIGN` to the last)."""
    longest = min(numel, _step(chunk) + ALIGN - 1)
    return torch.empty(longest, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class Draw:
    """``uniform_(a, b)`` or ``normal_(mean=a, std=b)`` of the whole tensor."""

    kind: str  # "uniform" | "normal"
    a: float
    b: float
    generator: torch.Generator | None

    def fill(self, buffer: torch.Tensor) -> None:
        """The draw on ``buffer`` (a whole tensor or one chunk)."""
        if self.kind == "uniform":
            buffer.uniform_(self.a, self.b, generator=self.generator)
        else:
            buffer.normal_(self.a, self.b, generator=self.generator)

    def run(self, out: torch.Tensor, box: Box, chunk: int) -> None:
        """Draw the whole tensor of ``box.shape`` chunk by chunk; keep ``box`` in ``out``."""
        numel = math.prod(box.shape)
        scratch = _scratch(numel, chunk, out)
        for start, stop in chunk_bounds(numel, chunk):
            buffer = scratch[: stop - start]
            self.fill(buffer)
            place(buffer, start, box, out)


@dataclass(frozen=True)
class TruncNormal:
    """``torch.nn.init.trunc_normal_(t, mean, std, a, b)`` (its branch for ``p > 0.3``)."""

    mean: float
    std: float
    a: float
    b: float
    generator: torch.Generator | None

    def run(self, out: torch.Tensor, box: Box, chunk: int) -> None:
        """The rejection sampling of the whole tensor, chunk by chunk; keep ``box`` in ``out``."""
        numel = math.prod(box.shape)
        scratch = _scratch(numel, chunk, out)
        # torch compares with the bounds cast to the tensor's dtype
        lo = torch.tensor(self.a, dtype=out.dtype).item()
        hi = torch.tensor(self.b, dtype=out.dtype).item()
        pending: torch.Tensor | None = None  # sorted flat positions still out of bounds
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        while pending is None or pending.numel():
            rejected = []
            for start, stop in chunk_bounds(numel, chunk):
                buffer = scratch[: stop - start]
                buffer.normal_(self.mean, self.std, generator=self.generator)
                if pending is None:  # the first draw: every element
                    place(buffer, start, box, out)
                    bad = torch.nonzero((buffer < lo) | (buffer > hi)).flatten() + start
                    flat = bad.to(index_dtype)
                else:  # a redraw: only the elements still out of bounds take it
                    ends = torch.tensor([start, stop], dtype=index_dtype)
                    first, last = torch.searchsorted(pending, ends).tolist()
                    flat = pending[first:last]
                    values = buffer[flat - start]
                    scatter(flat, values, box, out)
                    flat = flat[(values < lo) | (values > hi)]
                rejected.append(flat)
            pending = torch.cat(rejected)


Fill = Draw | TruncNormal


def _whole(fill: Fill, tensor: torch.Tensor, generator: torch.Generator) -> None:
    if isinstance(fill, TruncNormal):
        torch.nn.init.trunc_normal_(tensor, fill.mean, fill.std, fill.a, fill.b, generator)
    else:
        Draw(fill.kind, fill.a, fill.b, generator).fill(tensor)


def _sample(kind: str, generator: torch.Generator) -> Fill:
    if kind == "trunc_normal":  # 68% of the mass inside: several redraw rounds
        return TruncNormal(0.0, 1.0, -1.0, 1.0, generator)
    return Draw(kind, -0.5 if kind == "uniform" else 0.25, 2.0, generator)


@functools.cache
def proven(kind: str, dtype: torch.dtype) -> bool:
    """Whether ``kind`` (``"uniform"``, ``"normal"``, ``"trunc_normal"``) chunked on the CPU
    gives the whole call's ``dtype`` values and leaves the generator in the same state (checked
    once on a small tensor with odd chunks, on private generators)."""
    shape, seed = (13, 37), 20240613  # 481 elements: chunks of 64 and a tail of 33
    box = Box(shape, (3, 5), (10, 30))
    try:
        mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        out = torch.empty(box.local_shape, dtype=dtype)
        _sample(kind, mine).run(out, box, chunk=64)
        whole = torch.empty(shape, dtype=dtype)
        _whole(_sample(kind, theirs), whole, theirs)
    except (RuntimeError, TypeError, ValueError):
        return False
    same_state = torch.equal(mine.get_state(), theirs.get_state())
    return same_state and torch.equal(out, whole[3:10, 5:30])
