"""Worker for test_collectives_real.py: every collective's forward AND gradient on real gloo
processes, against single-process math that each rank recomputes from all ranks' inputs.

Each rank prints ``CHECK <name> OK``; any mismatch raises (the launcher reports the rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import shardwise as sw
from shardwise.communication import create_group, get_group_size, get_rank

Math = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def inputs(n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def check(
    name: str, shape: tuple[int, ...], op: torch.nn.Module, math: Math, members: list[int]
) -> None:
    """Run `op` on this rank's input; compare value and gradient with `math` over `members`."""
    rank, n = get_rank(), sw.communication.get_group_size()
    xs = [x.requires_grad_() for x in inputs(n, shape, seed=1)]
    outs = math([xs[r] for r in members])
    ws = inputs(n, tuple(outs[0].shape), seed=2)
    total = sum((o * ws[r]).sum() for o, r in zip(outs, members, strict=True))
    assert isinstance(total, torch.Tensor)
    total.backward()
    x = xs[rank].detach().clone().requires_grad_()
    y = op(x)
    y = y[0] if isinstance(y, tuple) else y
    (y * ws[rank]).sum().backward()
    want_y = outs[members.index(rank)].detach()
    want_g = xs[rank].grad if xs[rank].grad is not None else torch.zeros(shape)
    assert x.grad is not None
    if not torch.allclose(y.detach(), want_y, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{name}: forward differs on rank {rank}")
    if not torch.allclose(x.grad, want_g, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{name}: gradient differs on rank {rank}")
    print(f"CHECK {name} OK", flush=True)


def main() -> None:
    sw.communication.init()
    checks()
    sw.communication.release()


def checks() -> None:
    """Every check of this worker, in a job that has called ``init()`` (four_ranks_worker.py
    runs them in the tests' one 4-process job)."""
    rank, n = get_rank(), get_group_size()
    world = list(range(n))
    k = n
    check("AllReduce", (4, 3), sw.ops.AllReduce(), lambda xs: [sum(xs)] * k, world)
    check("AllReduce-max", (4, 3), sw.ops.AllReduce("max"),
          lambda xs: [torch.stack(xs).amax(0)] * k, world)  # fmt: skip
    check("AllGather", (2, 3), sw.ops.AllGather(), lambda xs: [torch.cat(xs)] * k, world)
    check("ReduceScatter", (2 * k, 3), sw.ops.ReduceScatter(),
          lambda xs: list(sum(xs).chunk(k)), world)  # fmt: skip
    check("Broadcast", (3, 2), sw.ops.Broadcast(n - 1), lambda xs: [xs[-1]] * k, world)

    def a2a(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat([x.chunk(k, 1)[i] for x in xs], 0) for i in range(k)]

    check("AlltoAll", (2 * k, 3 * k), sw.ops.AlltoAll(k, 1, 0), a2a, world)
    ring = sw.ops.NeighborExchange([(rank + 1) % n], [(rank - 1) % n], [[2, 3]], [[2, 3]])
    check("NeighborExchange", (2, 3), ring, lambda xs: [xs[(r - 1) % k] for r in range(k)], world)
    # a receiver expecting more than its peer sends: a ValueError (gloo delivered the shorter
    # message silently, the rest of the buffer left as it was)
    longer = sw.ops.NeighborExchange([(rank + 1) % n], [(rank - 1) % n], [[2, 4]], [[2, 3]])
    try:
        longer((torch.ones(2, 3),))
    except ValueError as e:
        assert "expects shape [2, 4]" in str(e) and "sent shape [2, 3]" in str(e), e
        # another dtype of the same size: the bytes would be read as the wrong numbers
        other = sw.ops.NeighborExchange([(rank + 1) % n], [(rank - 1) % n], [[2, 3]], [[2, 3]],
                                        recv_type=torch.int32)  # fmt: skip
        try:
            other((torch.ones(2, 3),))
        except ValueError as e:
            assert "of torch.int32" in str(e) and "of torch.float32" in str(e), e
            # a wider dtype than the receiver's (float64 to the default float32): named too (it
            # overflowed the receive buffer, and gloo aborted the process)
            try:
                ring((torch.ones(2, 3, dtype=torch.float64),))
            except ValueError as e:
                assert "of torch.float32" in str(e) and "of torch.float64" in str(e), e
                # a message to itself of another dtype: the same (it was cast silently)
                itself = sw.ops.NeighborExchange([rank], [rank], [[2]], [[2]])
                try:
                    itself((torch.ones(2, dtype=torch.float64),))
                except ValueError as e:
                    assert f"rank {rank} expects shape [2] of torch.float32 from rank" in str(e)
                    print("CHECK NeighborExchange-shapes OK", flush=True)
    # 1 x n strip, one-column halos, no wrap-around: direction 2 = right, 6 = left
    ids = [-1] * 8
    ids[2] = rank + 1 if rank + 1 < n else -1
    ids[6] = rank - 1 if rank > 0 else -1
    halo = sw.ops.NeighborExchangeV2(ids, [0, 0, 1, 1], ids, [0, 0, 1, 1])

    def strip(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        zero = torch.zeros(1, 1, 2, 1)
        return [
            torch.cat(
                [
                    xs[r - 1][..., -1:] if r > 0 else zero,
                    x,
                    xs[r + 1][..., :1] if r + 1 < k else zero,
                ],
                dim=3,
            )
            for r, x in enumerate(xs)
        ]

    check("NeighborExchangeV2", (1, 1, 2, 3), halo, strip, world)
    half = list(range(rank % 2, n, 2))
    create_group(f"parity{rank % 2}", half)
    sub = sw.ops.AllReduce(group=f"parity{rank % 2}")
    check("AllReduce-subgroup", (3,), sub, lambda xs: [sum(xs)] * len(half), half)
    check_buckets(rank, n, world, None)
    check_buckets(rank, n, half, f"parity{rank % 2}")
    print("CHECK Buckets OK", flush=True)
    check_pool(rank, n)
    print("CHECK BufferPool OK", flush=True)


def check_buckets(rank: int, n: int, members: list[int], group: str | None) -> None:
    """Bucketed AllGather / ReduceScatter, both transports (pairwise forced by a zero
    threshold; "coalesced": small buckets joining one message per peer in
    `_pairwise.coalesced`, with a one-member bucket of each kind too), two or more buckets in
    flight at once: the gathers equal the concatenation, the pairwise reduction equals the flat
    one bit for bit (both sum in group-rank order), every bucket recorded as one collective."""
    from shardwise.communication import _buckets, _pairwise

    k = len(members)
    shapes = [(2 * k, 3), (k,), (3 * k, 5)]
    pieces = [inputs(n, (s[0] // k, *s[1:]), seed=10 + i) for i, s in enumerate(shapes)]
    fulls = [inputs(n, s, seed=20 + i) for i, s in enumerate(shapes)]
    results: dict[object, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    pairwise, separate = _buckets.PAIRWISE_MIN_BYTES, _pairwise.SEPARATE_BYTES
    try:
        _bucket_results(rank, group, pieces, fulls, results)
    finally:  # (later checks in the same processes run with the defaults)
        _buckets.PAIRWISE_MIN_BYTES, _pairwise.SEPARATE_BYTES = pairwise, separate
    pos = members.index(rank)
    for scattered, gathered in results.values():
        for p, got in zip(pieces, gathered, strict=True):
            assert torch.equal(got, torch.cat([p[r] for r in members])), "bucket AllGather"
        for f, got in zip(fulls, scattered, strict=True):
            want = sum(f[r] for r in members).chunk(k)[pos]
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), "bucket ReduceScatter"
    for other in (0, "coalesced 1048576", "coalesced 40"):
        for a, b in zip(results[other][0], results[1 << 40][0], strict=True):
            assert torch.equal(a, b), f"{other} pairwise and flat ReduceScatter differ"


def _bucket_results(
    rank: int,
    group: str | None,
    pieces: list[list[torch.Tensor]],
    fulls: list[list[torch.Tensor]],
    results: dict[object, tuple[list[torch.Tensor], list[torch.Tensor]]],
) -> None:
    """`check_buckets`' runs (both transports, coalesced), their results into `results`."""
    from shardwise.communication import CommRecorder, _buckets, _pairwise
    from shardwise.communication._collectives import ReduceOp

    for threshold in (0, 1 << 40):
        _buckets.PAIRWISE_MIN_BYTES = threshold
        gather = _buckets.all_gather_bucket([p[rank] for p in pieces], group)
        scatter = _buckets.reduce_scatter_bucket([f[rank] for f in fulls], ReduceOp.SUM, group)
        results[threshold] = (scatter.wait(), gather.wait())
    for separate in (1 << 20, 40):  # 40 bytes: the 60-byte parts travel alone, not packed
        _pairwise.SEPARATE_BYTES = separate
        with CommRecorder() as rec:
            with _pairwise.coalesced():
                gathers = [_buckets.all_gather_bucket([pieces[0][rank]], group)]
                gathers.append(_buckets.all_gather_bucket([p[rank] for p in pieces[1:]], group))
                one = _buckets.reduce_scatter_bucket([fulls[0][rank]], ReduceOp.SUM, group)
                scatter = _buckets.reduce_scatter_bucket(
                    [f[rank] for f in fulls[1:]], ReduceOp.SUM, group
                )
            gathered = [t for g in gathers for t in g.wait()]
            results[f"coalesced {separate}"] = ([*one.wait(), *scatter.wait()], gathered)
        assert rec.count("AllGather") == 2 and rec.count("ReduceScatter") == 2, "one per bucket"


def check_pool(rank: int, n: int) -> None:
    """The packed send and receive buffers of pairwise messages go back to `_pairwise`'s pool
    once their message finished and are reused by the next exchange of the same sizes (new
    data, right results); with `POOL_BYTES` 0 nothing is kept."""
    from shardwise.communication import _buckets, _pairwise

    shapes = [(2 * n, 3), (n,), (n, 5)]  # small members: packed into one message per peer
    _pairwise._pool.clear()
    _pairwise._pooled[0] = 0
    seen: list[set[int]] = []
    for seed in (30, 40):
        pieces = [inputs(n, s, seed=seed + i) for i, s in enumerate(shapes)]
        with _pairwise.coalesced():
            pending = _buckets.all_gather_bucket([p[rank] for p in pieces], None)
        got = pending.wait()
        for p, g in zip(pieces, got, strict=True):
            assert torch.equal(g, torch.cat(p)), "pooled AllGather"
        seen.append({b.data_ptr() for free in _pairwise._pool.values() for b in free})
    # one packed send buffer (the same parts go to every peer) and a box per peer, all back
    assert len(seen[0]) == n, seen
    assert seen[0] == seen[1], "the second exchange reused the pooled buffers"
    assert _pairwise._pooled[0] == sum(
        b.numel() * b.element_size() for free in _pairwise._pool.values() for b in free
    )
    pool_bytes, _pairwise.POOL_BYTES = _pairwise.POOL_BYTES, 0
    _pairwise._pool.clear()
    _pairwise._pooled[0] = 0
    with _pairwise.coalesced():
        pending = _buckets.all_gather_bucket([torch.ones(n)], None)
    assert torch.equal(pending.wait()[0], torch.ones(n * n)) and not _pairwise._pool
    _pairwise.POOL_BYTES = pool_bytes


if __name__ == "__main__":
    main()
