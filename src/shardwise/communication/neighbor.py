"""Point-to-point primitives: `NeighborExchange` and the 2-D halo `NeighborExchangeV2`.

`NeighborExchange` sends a tuple of tensors to a list of ranks and receives a tuple from another
list. `NeighborExchangeV2` exchanges the borders of an NCHW tensor with up to 8 neighbours
(`DIRECTIONS`); `_halo_sends` cuts what goes out, `_assemble` pads the tensor and writes in
what came in.
A border sent towards direction d arrives as the receiver's opposite border ((d + 4) % 8), which
is how messages pair up (the direction is the tag). Gradients flow back along the same pairs.

Rank ids are global ranks; -1 means "no neighbour" (V2 only). In a simulated world the ids may
be per-rank expressions of `get_rank()`, e.g. ``[(rank + 1) % n]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise.communication import _sim
from shardwise.communication._collectives import check_member
from shardwise.communication._init import resolve_group
from shardwise.communication.primitives import (
    GroupArg,
    _check_group_arg,
    _check_tensor,
    _ExchangeFn,
    _per_rank,
    _tensors,
)

DIRECTIONS = (
    "top",
    "top_right",
    "right",
    "bottom_right",
    "bottom",
    "bottom_left",
    "left",
    "top_left",
)


def _check_int_list(op: str, name: str, value: Any, length: int | None, low: int) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"{op}: {name} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{op}: {name} must have {length} entries, got {len(value)}")
    for i, v in enumerate(value):
        for rv in _per_rank(v):
            if isinstance(rv, bool) or not isinstance(rv, int) or rv < low:
                raise ValueError(f"{op}: {name}[{i}]={rv!r} must be an int >= {low}")
    return list(value)


def _check_shapes(op: str, name: str, shapes: Any, length: int) -> list[tuple[int, ...]]:
    if not isinstance(shapes, list | tuple) or len(shapes) != length:
        raise ValueError(f"{op}: {name} must be a list of {length} shapes (one per rank id)")
    out = []
    for i, s in enumerate(shapes):
        if not isinstance(s, list | tuple | torch.Size) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s
        ):
            raise ValueError(f"{op}: {name}[{i}]={s!r} must be a list of non-negative ints")
        out.append(tuple(s))
    return out


def _check_peers(op: str, name: str, ids: Sequence[Any], group: GroupArg) -> None:
    """Each peer must be in the group; in a simulated world, in the copy of the group (one of
    its translates, which run at once) that the naming rank runs."""
    g = resolve_group(group)
    sim = _sim.current()
    for i, v in enumerate(ids):
        for rank, rv in enumerate(_per_rank(v)):
            if rv == -1:
                continue
            own = g.ranks if sim is None else tuple(sim.copy_of(rank, g.ranks))
            if own == g.ranks:
                check_member(op, rv, g, f"{name}[{i}]")
            elif rv not in own:
                raise ValueError(
                    f"{op}: {name}[{i}]={rv!r} on rank {rank} is not a rank of its group "
                    f"{g.name}{list(own)} (the translate of {g} that rank {rank} runs)"
                )


class NeighborExchange(nn.Module):
    """Send ``inputs[i]`` to ``send_rank_ids[i]`` and receive one tensor from each rank of
    `recv_rank_ids`, as MindSpore's NeighborExchange.

    Args:
        send_rank_ids: global ranks to send to (one per input tensor).
        recv_rank_ids: global ranks to receive from.
        recv_shapes: shape of each received tensor.
        send_shapes: shape of each input tensor (checked).
        recv_type: dtype of the received tensors (default float32).
        group: group name, or None for the world group.

    Example:
        >>> rank, n = get_rank(), get_group_size()
        >>> ring = sw.ops.NeighborExchange([(rank + 1) % n], [(rank - 1) % n], [[2, 3]], [[2, 3]])
        >>> (from_left,) = ring((x,))
    """

    def __init__(
        self,
        send_rank_ids: Sequence[int],
        recv_rank_ids: Sequence[int],
        recv_shapes: Sequence[Sequence[int]],
        send_shapes: Sequence[Sequence[int]],
        recv_type: torch.dtype = torch.float32,
        group: GroupArg = None,
    ) -> None:
        super().__init__()
        op = "NeighborExchange"
        _check_group_arg(op, group)
        self.send_rank_ids = _check_int_list(op, "send_rank_ids", send_rank_ids, None, 0)
        self.recv_rank_ids = _check_int_list(op, "recv_rank_ids", recv_rank_ids, None, 0)
        self.send_shapes = _check_shapes(op, "send_shapes", send_shapes, len(self.send_rank_ids))
        self.recv_shapes = _check_shapes(op, "recv_shapes", recv_shapes, len(self.recv_rank_ids))
        if not isinstance(recv_type, torch.dtype):
            raise TypeError(f"{op}: recv_type must be a torch.dtype, got {recv_type!r}")
        self.recv_type, self.group = recv_type, group

    def forward(self, inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        op = "NeighborExchange"
        xs = _tensors(op, inputs)
        if len(xs) != len(self.send_shapes):
            raise ValueError(
                f"{op}: got {len(xs)} input tensors but send_rank_ids/send_shapes name "
                f"{len(self.send_shapes)}"
            )
        for i, (x, shape) in enumerate(zip(xs, self.send_shapes, strict=True)):
            if tuple(x.shape) != shape:
                raise ValueError(
                    f"{op}: input {i} has shape {list(x.shape)} but send_shapes[{i}] is "
                    f"{list(shape)}"
                )
        _check_peers(op, "send_rank_ids", self.send_rank_ids, self.group)
        _check_peers(op, "recv_rank_ids", self.recv_rank_ids, self.group)
        plan = (
            op,
            [(r, 0) for r in self.send_rank_ids],
            [(r, 0) for r in self.recv_rank_ids],
            self.recv_shapes,
            self.recv_type,
            self.group,
        )
        outs: tuple[torch.Tensor, ...] = _ExchangeFn.apply(plan, *xs)
        return outs


def _halo_sends(x: torch.Tensor, lens: Sequence[int]) -> list[torch.Tensor]:
    """The 8 border blocks of `x` to send, in `DIRECTIONS` order; lens = [top, bottom, left,
    right] rows/columns."""
    top, bottom, left, right = lens
    h, w = x.shape[2], x.shape[3]
    rows = {"top": slice(0, top), "mid": slice(0, h), "bottom": slice(h - bottom, h)}
    cols = {"left": slice(0, left), "mid": slice(0, w), "right": slice(w - right, w)}
    where = [
        ("top", "mid"),
        ("top", "right"),
        ("mid", "right"),
        ("bottom", "right"),
        ("bottom", "mid"),
        ("bottom", "left"),
        ("mid", "left"),
        ("top", "left"),
    ]
    return [x[:, :, rows[r], cols[c]] for r, c in where]


def _recv_shapes(x: torch.Tensor, lens: Sequence[int]) -> list[tuple[int, ...]]:
    top, bottom, left, right = lens
    n, c, h, w = x.shape
    hw = [(top, w), (top, right), (h, right), (bottom, right)]
    hw += [(bottom, w), (bottom, left), (h, left), (top, left)]
    return [(n, c, a, b) for a, b in hw]


def _assemble(x: torch.Tensor, got: Sequence[torch.Tensor], lens: Sequence[int]) -> torch.Tensor:
    """Pad `x` by `lens` = [top, bottom, left, right] and write the received blocks into the
    border: [tl t tr] / [l x r] / [bl b br] (one allocation; autograd flows through the copies)."""
    top, bottom, left, right = lens
    h, w = x.shape[2], x.shape[3]
    out = torch.nn.functional.pad(x, (left, right, top, bottom))
    rows = {"t": slice(0, top), "m": slice(top, top + h), "b": slice(top + h, top + h + bottom)}
    cols = {"l": slice(0, left), "m": slice(left, left + w), "r": slice(left + w, left + w + right)}
    where = [("t", "m"), ("t", "r"), ("m", "r"), ("b", "r"), ("b", "m"), ("b", "l"), ("m", "l")]
    where.append(("t", "l"))
    for block, (r, c) in zip(got, where, strict=True):
        if block.numel():
            out[:, :, rows[r], cols[c]] = block
    return out


class NeighborExchangeV2(nn.Module):
    """2-D halo exchange of an NCHW tensor with up to 8 neighbours.

    Args:
        send_rank_ids: 8 global ranks (or -1), in the order top, top_right, right, bottom_right,
            bottom, bottom_left, left, top_left: who gets this rank's border in that direction.
        send_lens: [top, bottom, left, right]: rows / columns sent in each direction.
        recv_rank_ids: 8 global ranks (or -1): who this rank's halo in that direction comes from.
        recv_lens: [top, bottom, left, right]: halo rows / columns received.
        data_format: only ``"NCHW"``.
        group: group name, or None for the world group.

    Returns (forward): the input padded to (N, C, H + top + bottom, W + left + right) with the
    received halos; halos with no neighbour are zeros.

    Example:
        >>> # 1 x 2 grid: rank 0 left, rank 1 right, one-column halos
        >>> ids = [-1, -1, 1, -1, -1, -1, -1, -1] if rank == 0 else [-1] * 6 + [0, -1]
        >>> y = sw.ops.NeighborExchangeV2(ids, [0, 0, 1, 1], ids, [0, 0, 1, 1])(x)
    """

    def __init__(
        self,
        send_rank_ids: Sequence[int],
        send_lens: Sequence[int],
        recv_rank_ids: Sequence[int],
        recv_lens: Sequence[int],
        data_format: str = "NCHW",
        group: GroupArg = None,
    ) -> None:
        super().__init__()
        op = "NeighborExchangeV2"
        _check_group_arg(op, group)
        self.send_rank_ids = _check_int_list(op, "send_rank_ids", send_rank_ids, 8, -1)
        self.recv_rank_ids = _check_int_list(op, "recv_rank_ids", recv_rank_ids, 8, -1)
        self.send_lens = _check_int_list(op, "send_lens", send_lens, 4, 0)
        self.recv_lens = _check_int_list(op, "recv_lens", recv_lens, 4, 0)
        for name, ids in (("send_rank_ids", send_rank_ids), ("recv_rank_ids", recv_rank_ids)):
            per_rank = zip(*(_per_rank(v) for v in ids), strict=True)
            for rank_view in per_rank:
                real = [v for v in rank_view if v != -1]
                if len(set(real)) != len(real):
                    raise ValueError(f"{op}: {name}={list(rank_view)} repeats a rank")
        if data_format != "NCHW":
            raise ValueError(f"{op}: data_format={data_format!r}; only 'NCHW' is supported")
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "NeighborExchangeV2"
        _check_tensor(op, x)
        if x.dim() != 4:
            raise ValueError(f"{op}: input must be 4-D NCHW, got shape {list(x.shape)}")
        h, w = x.shape[2], x.shape[3]
        top, bottom, left, right = self.send_lens
        if top > h or bottom > h or left > w or right > w:
            raise ValueError(
                f"{op}: send_lens={self.send_lens} exceed the input's H={h} / W={w} "
                "(top/bottom <= H, left/right <= W)"
            )
        _check_peers(op, "send_rank_ids", self.send_rank_ids, self.group)
        _check_peers(op, "recv_rank_ids", self.recv_rank_ids, self.group)
        sends = _halo_sends(x, self.send_lens)
        plan = (
            op,
            [(r, d) for d, r in enumerate(self.send_rank_ids)],
            [(r, (d + 4) % 8) for d, r in enumerate(self.recv_rank_ids)],
            _recv_shapes(x, self.recv_lens),
            x.dtype,
            self.group,
        )
        got: tuple[torch.Tensor, ...] = _ExchangeFn.apply(plan, *sends)
        return _assemble(x, got, self.recv_lens)
