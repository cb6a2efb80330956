"""Random draws of the plan executor's ops as one device draws them (for `_local`).

- `empty_as`: an empty tensor of the whole shape laid out in memory as one device lays it out
  (a random fill runs in memory order).
- `GlobalDraws`: while one op runs on this rank's blocks, its random in-place fills draw the
  whole tensor as one device does and keep this rank's block (`NodePlan.draws`).
- `UnplannedDraw`: an op drew a random tensor its plan has no draw for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise import communication as comm
from shardwise._torch.dispatch import TorchDispatchMode
from shardwise.parallel._errors import UnsupportedParallelError
from shardwise.planner import Placed
from shardwise.planner._draws import is_fill, is_like_draw
from shardwise.redistribution import local_block

Shape = tuple[int, ...]


def empty_as(
    block: torch.Tensor, shape: Shape, order: Sequence[int] | None = None
) -> Callable[[], torch.Tensor]:
    """A maker of an empty tensor of global `shape` laid out in memory as one device lays out
    its whole tensor: its dims in `order` (the plan's, from the capture: `NodePlan.draws`),
    else in the order ``empty_like`` lays out `block` (this rank's block of it; exact unless
    the block has a size-1 dim the whole has not, when strides tie). A random fill runs in
    memory order, so a mask drawn into it holds one device's numbers where one device's are
    (a dropout after a transpose included)."""
    if order is None:
        strides = torch.empty_like(block).stride()
        order = sorted(range(len(strides)), key=lambda d: -strides[d])  # (outer first; stable)
    dims = list(order)
    back = [dims.index(d) for d in range(len(dims))]
    dtype, device = block.dtype, block.device

    def make() -> torch.Tensor:
        return torch.empty([shape[d] for d in dims], dtype=dtype, device=device).permute(back)

    return make


class UnplannedDraw(UnsupportedParallelError):
    """An op drew a random tensor its plan has no draw for (planned in ``eval()``, say)."""


class GlobalDraws(TorchDispatchMode):
    """While one op runs on this rank's blocks: its k-th random in-place fill (``bernoulli_``,
    ``uniform_`` ...) fills the tensor with this rank's block of the whole tensor drawn as one
    device draws it (`communication.replicated_draw`, then `local_block`; `draws` [k]: the
    filled tensor's placement, global shape and memory order, from the plan); a random tensor
    shaped like another (``randn_like``) is this rank's block of the whole drawn so."""

    def __init__(self, draws: Sequence[tuple[Placed, Shape, Sequence[int]]], who: str) -> None:
        super().__init__()
        self.draws, self.who, self.k = draws, who, 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        like = is_like_draw(func)
        if not like and not is_fill(func):
            return func(*args, **kwargs)
        if self.k >= len(self.draws):
            raise UnplannedDraw(
                f"{self.who}: drew more random tensors ({func}) than the plan has "
                f"({len(self.draws)}); it must run the same ops every call"
            )
        placed, shape, order = self.draws[self.k]
        self.k += 1
        t: torch.Tensor = args[0]
        rest = args[1:]
        empty = empty_as(t, shape, order)
        whole = comm.replicated_draw(lambda: func(empty(), *rest, **kwargs))
        if like:
            return local_block(whole, placed.layout, shape).clone()
        with torch.no_grad():
            return t.copy_(local_block(whole, placed.layout, shape))
