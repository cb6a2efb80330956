"""The seven collective primitives of manual parallel, each checked on every rank.

Run: ``shardwise run --worker_num 8 --log_dir log_output --join True examples/collectives.py``
(works for any worker count >= 2; the 2-D halo exchange lays ranks out as a 2 x N/2 grid).

Every rank builds inputs that depend only on ranks, so each can compute the expected result of
every collective by itself; a mismatch raises (and the launcher reports the failing rank).
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.communication import create_group, get_group_size, get_rank


def data(rank: int, rows: int = 4) -> torch.Tensor:
    """Rank `rank`'s input: rows x 3 values ``100 * rank + i``."""
    return (torch.arange(rows * 3, dtype=torch.float32) + 100 * rank).reshape(rows, 3)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.detach()
    if not torch.allclose(got, want):
        raise AssertionError(f"{name}: got {got.tolist()} expected {want.tolist()}")
    summary = f"shape {list(got.shape)} sum {float(got.sum()):g}"
    print(f"[rank {get_rank()}] {name:<34} OK  {summary}", flush=True)


def world_collectives(rank: int, n: int) -> None:
    x = data(rank, rows=2 * n).requires_grad_()
    everyone = [data(r, rows=2 * n) for r in range(n)]

    y = sw.ops.AllReduce()(x)
    check("AllReduce(SUM)", y, sum(everyone))
    y.sum().backward()
    check("  grad of AllReduce", x.grad, torch.full_like(x, n))

    check("AllReduce(MAX)", sw.ops.AllReduce("max")(x), everyone[-1])
    check("AllGather", sw.ops.AllGather()(x), torch.cat(everyone))
    chunk = 2 * n // n
    check(
        "ReduceScatter(SUM)",
        sw.ops.ReduceScatter()(x),
        sum(everyone)[rank * chunk : (rank + 1) * chunk],
    )
    (b,) = sw.ops.Broadcast(n - 1)((x,))
    check(f"Broadcast(root_rank={n - 1})", b, everyone[n - 1])
    a2a = sw.ops.AlltoAll(n, 0, 1)(x)
    check("AlltoAll(split 0, concat 1)", a2a, torch.cat([e.chunk(n, 0)[rank] for e in everyone], 1))
    ring = sw.ops.NeighborExchange(
        [(rank + 1) % n], [(rank - 1) % n], [list(x.shape)], [list(x.shape)]
    )
    (left,) = ring((x,))
    check("NeighborExchange(ring)", left, everyone[(rank - 1) % n])


def halo_exchange(rank: int, n: int) -> None:
    """2 x n/2 grid, one-row/one-column halos, no wrap-around."""
    cols = n // 2
    row, col = divmod(rank, cols)

    def at(r: int, c: int) -> int:
        return r * cols + c if 0 <= r < 2 and 0 <= c < cols else -1

    steps = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]
    ids = [at(row + dr, col + dc) for dr, dc in steps]
    x = torch.full((1, 1, 2, 2), float(rank))
    y = sw.ops.NeighborExchangeV2(ids, [1, 1, 1, 1], ids, [1, 1, 1, 1])(x)
    want = torch.zeros(1, 1, 4, 4)
    want[..., 1:3, 1:3] = rank
    blocks = [(0, slice(1, 3)), (0, 3), (slice(1, 3), 3), (3, 3)]
    blocks += [(3, slice(1, 3)), (3, 0), (slice(1, 3), 0), (0, 0)]
    for peer, (r, c) in zip(ids, blocks, strict=True):
        if peer != -1:
            want[0, 0, r, c] = peer
    check("NeighborExchangeV2(2-D halo)", y, want)


def group_collectives(rank: int, n: int) -> None:
    parity = rank % 2
    members = list(range(parity, n, 2))
    name = "even" if parity == 0 else "odd"
    create_group(name, members)
    x = data(rank)
    y = sw.ops.AllReduce(group=name)(x)
    check(f"AllReduce on group {name}", y, sum(data(r) for r in members))
    check(
        f"AllGather on group {name}",
        sw.ops.AllGather(group=name)(x),
        torch.cat([data(r) for r in members]),
    )


def main() -> None:
    sw.communication.init()
    rank, n = get_rank(), get_group_size()
    if n < 2 or n % 2:
        raise SystemExit(f"run with an even number of workers >= 2 (got {n})")
    with sw.CommRecorder() as rec:
        world_collectives(rank, n)
        halo_exchange(rank, n)
        if n >= 4:
            group_collectives(rank, n)
    if rank == 0:
        print(rec.summary(), flush=True)
    print(f"[rank {rank}] all collectives OK", flush=True)
    sw.communication.release()


if __name__ == "__main__":
    main()
