"""The seven collective primitives vs the direct ``torch.distributed`` call a user would write.

For every N in ``--ranks`` one gloo job runs `worker`, which for each message size and each
collective (`collective_cases.BUILDERS`, one `Case` each):

1. `_check`: runs both sides once on random inputs and compares the outputs (``match``);
2. `_accounting`: one shardwise call under a `CommRecorder` (bytes it records) and the
   `bytes_bound` of the call, both averaged over the ranks;
3. `harness.compare`: times both sides side by side on zero-filled inputs (zeros keep the
   in-place torch calls from overflowing), reading the loopback byte counter around each
   timed loop.

`run` spawns the jobs, prints one table (`table`) and saves ``collectives.json`` /
``collectives.txt``. Size = bytes of the float32 input on one rank (S); AllGather gathers N·S,
ReduceScatter scatters S into N chunks; the halo exchange sends 1-pixel borders of an
(1, C, H, W) tensor of S bytes on a 2 x N/2 grid.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from bench import harness
from bench._common import jobs, n_label, oversubscribed_notes, report_meta
from bench.collective_cases import BASELINES, BUILDERS, COLLECTIVES, Case
from bench.harness import BenchConfig, MiB, Table, compare, fmt_bytes, fmt_ms

OVERSUBSCRIBED = (
    "* more workers than the {cores} cores: processes are time-sliced, so these times measure "
    "scheduling as much as communication; never report them as speed-ups"
)


@dataclass(frozen=True)
class CollectiveResult:
    """One row: a collective at N ranks and one message size, both sides."""

    collective: str
    world_size: int
    size_bytes: int
    shardwise_s: float
    torch_s: float
    recorded_bytes: float  # per rank, shardwise's CommRecorder (mean over ranks)
    bound_bytes: float  # per rank, bytes_bound (mean over ranks)
    lo_shardwise_bytes: float | None  # measured loopback bytes per rank per call
    lo_torch_bytes: float | None
    iters: int
    reps: int
    match: bool  # both sides gave the same result on random inputs
    oversubscribed: bool  # more workers than cores

    @property
    def ratio(self) -> float:
        """shardwise time / torch time (> 1: shardwise is slower)."""
        return self.shardwise_s / self.torch_s

    def __str__(self) -> str:
        return (
            f"{self.collective} N={self.world_size} {fmt_bytes(self.size_bytes)}: shardwise "
            f"{fmt_ms(self.shardwise_s)} ms vs torch {fmt_ms(self.torch_s)} ms (x{self.ratio:.2f})"
            f", lo {fmt_bytes(self.lo_shardwise_bytes)} vs {fmt_bytes(self.lo_torch_bytes)}/rank"
        )


# --------------------------------------------------------------------------- the worker


def _flat(out: Any) -> Any:
    import torch

    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([p.reshape(-1) for p in parts])


def _all_ranks_true(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _check(case: Case, rank: int) -> bool:
    """Both sides on the same random input give the same result (on every rank)."""
    import torch

    x = torch.randn(case.shape, generator=torch.Generator().manual_seed(1000 + rank))
    got = _flat(case.shardwise(x))
    want = _flat(case.torch(x.clone() if case.inplace else x))
    same = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    return _all_ranks_true(same)


def _accounting(case: Case, kind: str, n: int) -> tuple[float, float]:
    """(bytes per rank recorded by CommRecorder, bytes_bound), each a mean over the ranks."""
    import torch
    import torch.distributed as dist

    from shardwise.communication import CommRecorder, bytes_bound

    with CommRecorder() as rec:
        case.shardwise(torch.zeros(case.shape))
    both = torch.tensor(
        [rec.total_bytes(), bytes_bound(kind, case.sent_bytes, n)], dtype=torch.float64
    )
    dist.all_reduce(both)
    return both[0].item() / n, both[1].item() / n


def schedule(size: int, quick: bool) -> tuple[int, int, int]:
    """(calls per repetition, repetitions, warm-up calls) for a message size."""
    if quick:
        return 2, 2, 1
    return max(2, min(10, (4 * MiB) // max(size, 1))), 7, 1


def _measure(
    kind: str, n: int, rank: int, size: int, args: dict[str, Any], barrier: float | None
) -> dict[str, Any]:
    import torch

    numel = max(n, size // 4 // n * n)
    case = BUILDERS[kind](n, rank, numel)
    match = _check(case, rank)
    recorded, bound = _accounting(case, kind, n)
    iters, reps, warmup = schedule(size, args["quick"])
    x = torch.zeros(case.shape)
    m = compare(
        {"shardwise": lambda: case.shardwise(x), "torch": lambda: case.torch(x)},
        iters=iters,
        reps=reps,
        warmup=warmup,
        barrier=barrier,
    )
    row = CollectiveResult(
        collective=kind,
        world_size=n,
        size_bytes=math.prod(case.shape) * 4,
        shardwise_s=m["shardwise"].median_s,
        torch_s=m["torch"].median_s,
        recorded_bytes=recorded,
        bound_bytes=bound,
        lo_shardwise_bytes=m["shardwise"].median_lo_bytes,
        lo_torch_bytes=m["torch"].median_lo_bytes,
        iters=iters,
        reps=reps,
        match=match,
        oversubscribed=n > (os.cpu_count() or 1),
    )
    return asdict(row)


def worker(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every (size, collective) on this job's N ranks; rank 0 returns the rows."""
    from shardwise.communication import get_group_size, get_rank

    n, rank = get_group_size(), get_rank()
    barrier = harness.barrier_bytes()
    rows = [
        _measure(kind, n, rank, size, args, barrier)
        for size in args["sizes"]
        for kind in args["collectives"]
    ]
    return rows if rank == 0 else None


# --------------------------------------------------------------------------- the parent


def _lo(measured: float | None, size: int) -> str:
    if measured is None:
        return "n/a"
    return f"{fmt_bytes(measured)} ({measured / size:.2f}S)"


def table(rows: list[CollectiveResult]) -> Table:
    """One line per (collective, N, size), grouped by collective."""
    t = Table(
        "Collectives on gloo: shardwise primitive vs the direct torch.distributed call",
        ["collective", "N", "size S", "shardwise ms", "torch ms", "ratio", "recorded/rank",
         "bound/rank", "lo shardwise/rank", "lo torch/rank"],
    )  # fmt: skip
    order = {k: i for i, k in enumerate(COLLECTIVES)}
    rows = sorted(rows, key=lambda r: (order[r.collective], r.world_size, r.size_bytes))
    for i, r in enumerate(rows):
        if i and r.collective != rows[i - 1].collective:
            t.rows.append([])
        t.rows.append(
            [
                r.collective + ("" if r.match else " (MISMATCH)"),
                n_label(r),
                fmt_bytes(r.size_bytes),
                fmt_ms(r.shardwise_s),
                fmt_ms(r.torch_s),
                f"{r.ratio:.2f}",
                fmt_bytes(r.recorded_bytes),
                fmt_bytes(r.bound_bytes),
                _lo(r.lo_shardwise_bytes, r.size_bytes),
                _lo(r.lo_torch_bytes, r.size_bytes),
            ]
        )
    return t


def _notes(rows: list[CollectiveResult], cores: int) -> list[str]:
    notes = [
        "ms: per call, median of the repetitions, max over ranks; ratio = shardwise / torch "
        "(> 1: shardwise slower); both sides alternate within the same job",
        "recorded: bytes/rank shardwise's CommRecorder reports; bound: bytes_bound (ring / "
        "pairwise minimum); both averaged over the ranks",
        "lo: measured bytes sent per rank per call on this host's loopback (/proc/net/dev lo "
        "tx / N / calls), incl. TCP/IP headers and ACKs, the two framing barriers subtracted; "
        "any other loopback traffic on the host at the time is counted too. (xS) = multiple of "
        "the input size S",
        "torch side: " + "; ".join(f"{k}: {v}" for k, v in BASELINES.items()),
    ]
    notes += oversubscribed_notes(rows, cores, OVERSUBSCRIBED)
    if not all(r.match for r in rows):
        notes.append("MISMATCH: the two sides gave different results; that row compares nothing")
    return notes


def run(config: BenchConfig) -> str:
    """Spawn one job per N, print and save the table; return the printed text."""
    kinds = list(config.collectives or COLLECTIVES)
    unknown = sorted(set(kinds) - set(COLLECTIVES))
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; choose from {', '.join(COLLECTIVES)}")
    args = {"sizes": list(config.sizes), "collectives": kinds, "quick": config.quick}
    got = jobs("collectives", config, config.ranks, args)
    rows = [CollectiveResult(**r) for _, results in got for r in results[0]]
    t = table(rows)
    t.notes = _notes(rows, os.cpu_count() or 1)
    text = str(t)
    data = {
        "meta": report_meta(config, baselines=BASELINES),
        "rows": [{**asdict(r), "ratio": r.ratio} for r in rows],
    }
    harness.save_report(config.out_dir, "collectives", data, text)
    return text
