"""`exchange`: point-to-point sends and receives (NeighborExchange and its V2 halo form).

`exchange` resolves the group, then moves the messages: in a simulated world the simulator
answers (`_sim`), in a job `_p2p` posts one batch of ``isend`` / ``irecv`` (after checking
every peer is in the group, `check_member`), with the messages a rank sends to itself
delivered by a local copy (`_to_self`: gloo has no pair to itself). The call is recorded as a
`CommRecord` with the bytes sent to other ranks. It is not traced (`_trace`): only some of a
group's ranks take part in point-to-point.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.communication import _sim, recorder
from shardwise.communication._collectives import check_member
from shardwise.communication._init import Group, resolve_group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_self(
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    outs: Sequence[torch.Tensor],
    recv_from: Sequence[tuple[int, int]],
    me: int,
) -> set[int]:
    """Messages a rank sends to itself, delivered by a local copy (gloo has no pair to itself):
    the receive slots filled, matched with the sends by tag, in order."""
    filled: set[int] = set()
    for x, (dst, tag) in zip(sends, send_to, strict=True):
        if dst != me:
            continue
        for j, (src, rtag) in enumerate(recv_from):
            if src == me and rtag == tag and j not in filled:
                outs[j].copy_(x.detach().reshape(outs[j].shape))
                filled.add(j)
                break
    return filled


def _p2p(
    kind: str,
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    recv_from: Sequence[tuple[int, int]],
    recv_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    g: Group,
) -> tuple[list[torch.Tensor], int]:
    """`exchange` in a real job: (the received tensors, the bytes sent to other ranks)."""
    for peer, _ in [*send_to, *recv_from]:
        if peer != -1:
            check_member(kind, peer, g, "send/recv rank id")
    outs = [
        (torch.zeros if src == -1 else torch.empty)(tuple(s), dtype=dtype, device=device)
        for s, (src, _) in zip(recv_shapes, recv_from, strict=True)
    ]
    me = dist.get_rank()
    to_self = _to_self(sends, send_to, outs, recv_from, me)
    ops = [
        dist.P2POp(dist.isend, x.detach().contiguous(), dst, g.pg, tag)
        for x, (dst, tag) in zip(sends, send_to, strict=True)
        if dst not in (-1, me) and x.numel() > 0
    ]
    ops += [
        dist.P2POp(dist.irecv, out, src, g.pg, tag)
        for j, (out, (src, tag)) in enumerate(zip(outs, recv_from, strict=True))
        if src != -1 and j not in to_self and out.numel() > 0
    ]
    if ops:  # not traced: only some of the group's ranks take part in point-to-point
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    sent = sum(_nbytes(x) for x, (d, _) in zip(sends, send_to, strict=True) if d not in (-1, me))
    return outs, sent


def exchange(
    kind: str,
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    recv_from: Sequence[tuple[int, int]],
    recv_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    group: str | Group | None,
) -> list[torch.Tensor]:
    """Point-to-point: send ``sends[i]`` to ``send_to[i] = (global rank, tag)``; receive slot j
    from ``recv_from[j] = (global rank, tag)`` with shape ``recv_shapes[j]``. A peer of -1 means
    "no transfer" (that receive slot holds zeros). Messages with the same source, destination
    and tag pair up in order. Every peer must be a member of `group`.
    """
    g = resolve_group(group)
    start = recorder.start()
    sim = _sim.current()
    if sim is not None:
        outs, sent = sim.exchange(kind, sends, send_to, recv_from, recv_shapes, dtype, g.ranks)
    else:
        outs, sent = _p2p(kind, sends, send_to, recv_from, recv_shapes, dtype, device, g)
    if recorder.recording():
        numel = sum(x.numel() for x in sends)
        recorder.record(kind, g.ranks, dtype, numel, sent, recorder.timer() - start)
    return outs
