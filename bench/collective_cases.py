"""The two sides of each collective benchmark: the shardwise primitive and the direct
``torch.distributed`` call a user would write, built per rank as a `Case`.

`BUILDERS` maps each name of `COLLECTIVES` to a builder ``(N, rank, numel) -> Case``;
`BASELINES` says in words what the torch side calls. The torch side does what a user would:
in place where torch's call is in place (all_reduce, broadcast), a freshly allocated output
otherwise. `NeighborExchangeV2` is compared with a hand-written 8-direction halo exchange of
1-pixel borders on a 2 x N/2 grid (`_halo`), in the primitive's tag convention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COLLECTIVES = (
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Broadcast",
    "AlltoAll",
    "NeighborExchange",
    "NeighborExchangeV2",
)
BASELINES = {
    "AllReduce": "dist.all_reduce (in place)",
    "AllGather": "dist.all_gather_into_tensor",
    "ReduceScatter": "dist.reduce_scatter_tensor",
    "Broadcast": "dist.broadcast (in place)",
    "AlltoAll": "dist.all_to_all_single",
    "NeighborExchange": "dist.batch_isend_irecv ring",
    "NeighborExchangeV2": "hand-written batch_isend_irecv halo",
}


@dataclass
class Case:
    """Both sides of one collective on this rank: callables taking the input tensor."""

    shape: tuple[int, ...]
    shardwise: Callable[[Any], Any]
    torch: Callable[[Any], Any]
    sent_bytes: int  # the nbytes argument of bytes_bound for this rank
    inplace: bool = False  # the torch side overwrites its input


# --------------------------------------------------------------------------- the cases


def _all_reduce(n: int, rank: int, numel: int) -> Case:
    import torch.distributed as dist

    import shardwise as sw

    def ref(x: Any) -> Any:
        dist.all_reduce(x)
        return x

    return Case((numel,), sw.ops.AllReduce(), ref, numel * 4, inplace=True)


def _all_gather(n: int, rank: int, numel: int) -> Case:
    import torch.distributed as dist

    import shardwise as sw

    def ref(x: Any) -> Any:
        out = x.new_empty((n * x.shape[0],))
        dist.all_gather_into_tensor(out, x)
        return out

    return Case((numel,), sw.ops.AllGather(), ref, numel * 4)


def _reduce_scatter(n: int, rank: int, numel: int) -> Case:
    import torch.distributed as dist

    import shardwise as sw

    def ref(x: Any) -> Any:
        out = x.new_empty((x.shape[0] // n,))
        dist.reduce_scatter_tensor(out, x)
        return out

    return Case((numel,), sw.ops.ReduceScatter(), ref, numel * 4)


def _broadcast(n: int, rank: int, numel: int) -> Case:
    import torch.distributed as dist

    import shardwise as sw

    def ref(x: Any) -> Any:
        dist.broadcast(x, src=0)
        return x

    return Case((numel,), sw.ops.Broadcast(0), ref, numel * 4, inplace=True)


def _all_to_all(n: int, rank: int, numel: int) -> Case:
    import torch
    import torch.distributed as dist

    import shardwise as sw

    def ref(x: Any) -> Any:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    return Case((numel,), sw.ops.AlltoAll(n, 0, 0), ref, numel * 4)


def _ring(n: int, rank: int, numel: int) -> Case:
    import torch
    import torch.distributed as dist

    import shardwise as sw

    right, left = (rank + 1) % n, (rank - 1) % n
    op = sw.ops.NeighborExchange([right], [left], [[numel]], [[numel]])

    def ref(x: Any) -> Any:
        got = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, got, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got

    return Case((numel,), lambda x: op((x,)), ref, numel * 4)


# (row, col) offsets of the 8 directions, in NeighborExchangeV2's order
_OFFSETS = ((-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1))
_SIDE = {-1: slice(0, 1), 0: slice(1, -1), 1: slice(-1, None)}  # halo slot of a padded axis
_EDGE = {-1: slice(0, 1), 0: slice(None), 1: slice(-1, None)}  # border of the input axis


def _nchw(numel: int) -> tuple[int, int, int, int]:
    """An (1, C, H, W) shape of at most `numel` elements, H and W as square as powers allow."""
    c = 16 if numel >= 256 else 1
    hw = max(1, numel // c)
    h = 2 ** (int(math.log2(hw)) // 2)
    return (1, c, h, hw // h)


def _halo(n: int, rank: int, numel: int) -> Case:
    import torch
    import torch.distributed as dist

    import shardwise as sw

    rows = 2 if n % 2 == 0 else 1
    cols = n // rows
    r, c = divmod(rank, cols)
    peers = [
        (r + dr) * cols + (c + dc) if 0 <= r + dr < rows and 0 <= c + dc < cols else -1
        for dr, dc in _OFFSETS
    ]
    op = sw.ops.NeighborExchangeV2(peers, [1, 1, 1, 1], peers, [1, 1, 1, 1])
    shape = _nchw(numel)

    def ref(x: Any) -> Any:
        out = x.new_zeros(x.shape[0], x.shape[1], x.shape[2] + 2, x.shape[3] + 2)
        out[:, :, 1:-1, 1:-1] = x
        ops, got = [], []
        for d, ((dr, dc), peer) in enumerate(zip(_OFFSETS, peers, strict=True)):
            if peer < 0:
                continue
            send = x[:, :, _EDGE[dr], _EDGE[dc]].contiguous()
            buf = torch.empty_like(out[:, :, _SIDE[dr], _SIDE[dc]])
            ops += [dist.P2POp(dist.isend, send, peer, tag=d)]
            ops += [dist.P2POp(dist.irecv, buf, peer, tag=(d + 4) % 8)]
            got.append((dr, dc, buf))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for dr, dc, buf in got:
            out[:, :, _SIDE[dr], _SIDE[dc]] = buf
        return out

    _, ch, h, w = shape
    sent = sum(
        4 * ch * (h if dr == 0 else 1) * (w if dc == 0 else 1)
        for (dr, dc), peer in zip(_OFFSETS, peers, strict=True)
        if peer >= 0
    )
    return Case(shape, op, ref, sent)


BUILDERS: dict[str, Callable[[int, int, int], Case]] = {
    "AllReduce": _all_reduce,
    "AllGather": _all_gather,
    "ReduceScatter": _reduce_scatter,
    "Broadcast": _broadcast,
    "AlltoAll": _all_to_all,
    "NeighborExchange": _ring,
    "NeighborExchangeV2": _halo,
}
