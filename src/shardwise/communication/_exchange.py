"""`exchange`: point-to-point sends and receives (NeighborExchange and its V2 halo form).

`exchange` resolves the group, then moves the messages: in a simulated world the simulator
answers (`_sim`), in a job `_p2p` posts one batch of ``isend`` / ``irecv`` (after checking
every peer is in the group, `check_member`), with the messages a rank sends to itself
delivered by a local copy (`_to_self`: gloo has no pair to itself). The call is recorded as a
`CommRecord` with the bytes sent to other ranks. It is not traced (`_trace`): only some of a
group's ranks take part in point-to-point. Each message carries a header of its dtype and
shape (`HEADER`, 128 bytes; not counted in the recorded bytes), checked by the receiver: a
message of another shape or dtype that fits the receiver's buffer is a ValueError naming both
(gloo would deliver a shorter one silently, into a buffer whose tail it leaves as it was). On
gloo the buffer has room for the expected number of elements of any dtype, so a message of the
expected shape in another dtype is named too; one with more elements fails in gloo (the process
aborts). A message a rank sends itself is checked alike (`_to_self`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.communication import _fingerprint, _sim, recorder
from shardwise.communication._collectives import _is_gloo, check_member
from shardwise.communication._init import Group, resolve_group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_self(
    kind: str,
    sends: Sequence[torch.Tensor],
    send_to: Sequence[tuple[int, int]],
    outs: Sequence[torch.Tensor],
    recv_from: Sequence[tuple[int, int]],
    me: int,
) -> set[int]:
    """Messages a rank sends to itself, delivered by a local copy (gloo has no pair to itself):
    the receive slots filled, matched with the sends by tag, in order; another shape or dtype
    than the slot's is the ValueError of a message from another rank."""
    filled: set[int] = set()
    for x, (dst, tag) in zip(sends, send_to, strict=True):
        if dst != me:
            continue
        for j, (src, rtag) in enumerate(recv_from):
            if src == me and rtag == tag and j not in filled:
                if x.shape != outs[j].shape or x.dtype != outs[j].dtype:
                    _mismatch(kind, outs[j], me, me, list(x.shape), x.dtype)
                outs[j].copy_(x.detach())
                filled.add(j)
                break
    return filled


HEADER = _fingerprint.LENGTH
"""int64 entries before each message's bytes in a job: its `_fingerprint` (dtype and shape):
gloo delivers a shorter message than the receiver expects without a word, leaving the rest of
the buffer as it was."""


def _framed(x: torch.Tensor) -> torch.Tensor:
    """`x`'s bytes after a header of its dtype and shape (`HEADER`)."""
    head = _fingerprint.fingerprint(x).to(x.device).view(torch.uint8)
    body = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([head, body])


def _mismatch(
    kind: str, out: torch.Tensor, src: int, me: int, shape: list[int], sent: torch.dtype | None
) -> None:
    raise ValueError(
        f"{kind}: rank {me} expects shape {list(out.shape)} of {out.dtype} from rank {src}, "
        f"which sent shape {shape} of {sent or 'another dtype'}: make recv_shapes and recv_type "
        f"match the sender's send_shapes and dtype"
    )


def _unframed(kind: str, buf: torch.Tensor, out: torch.Tensor, src: int, me: int) -> None:
    """Check the header of a message received into `buf` against `out` (the shape and dtype
    this rank expects) and copy the message's bytes into `out`."""
    head = buf[: HEADER * 8].view(torch.int64).tolist()
    if head != _fingerprint.fingerprint(out).tolist():
        _mismatch(kind, out, src, me, *_fingerprint.read(head))
    out.copy_(buf[HEADER * 8 : HEADER * 8 + _nbytes(out)].view(out.dtype).view(out.shape))


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
    to_self = _to_self(kind, sends, send_to, outs, recv_from, me)
    ops = [  # (an empty message is not sent, nor received: the simulated world's rule)
        dist.P2POp(dist.isend, _framed(x), dst, g.pg, tag)
        for x, (dst, tag) in zip(sends, send_to, strict=True)
        if dst not in (-1, me) and x.numel() > 0
    ]
    # (gloo: room for the expected elements of any dtype, so that another dtype is named, not
    # a gloo abort; other backends want the sizes of a send and its receive equal)
    width = _fingerprint.WIDEST if _is_gloo(g) else 0
    received = {
        j: torch.empty(
            HEADER * 8 + max(out.numel() * width, _nbytes(out)), dtype=torch.uint8, device=device
        )
        for j, (out, (src, _)) in enumerate(zip(outs, recv_from, strict=True))
        if src != -1 and j not in to_self and out.numel() > 0
    }
    ops += [dist.P2POp(dist.irecv, buf, recv_from[j][0], g.pg, recv_from[j][1])
            for j, buf in received.items()]  # fmt: skip
    if ops:  # not traced: only some of the group's ranks take part in point-to-point
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for j, buf in received.items():
        _unframed(kind, buf, outs[j], recv_from[j][0], me)
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
