"""Manual data parallel (seed 004's MNIST MLP): shardwise vs DDP vs one process, per step.

For every N (default 2 and 4) one gloo job runs `worker`. Each rank trains the seed's MLP
(Flatten, Linear 784-512, ReLU, Linear 512-512, ReLU, Linear 512-10; SGD lr 1e-2) on its
32/N rows of a global batch of 32 (synthetic MNIST-shaped inputs, the same on every rank),
three ways:

- ``shardwise``: seed 004's step: ``loss = sw.ops.AllReduce()(cross_entropy(logits, y)) / N``,
  ``loss.backward()``, ``sw.nn.DistributedGradReducer(net.parameters())()``, ``opt.step()``;
- ``DDP``: ``torch.nn.parallel.DistributedDataParallel(net)``, plain cross entropy;
- ``one process``: rank 0 alone trains on the whole batch of 32 (the other ranks wait in the
  closing barrier, which sleeps), with the faster of 1 thread and all cores.

`_check` trains fresh copies a few steps and compares the parameters; `_accounting` records one
shardwise step with `CommRecorder`; `harness.compare` then times the three side by side (each
call a chunk of steps, alternating order). `run` prints two tables (step time; communication)
and saves ``manual_dp.json`` / ``manual_dp.txt``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from bench import _common as common
from bench import harness
from bench._common import chunk, n_label
from bench.harness import BenchConfig, Table, compare, fmt_bytes, fmt_ms

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 32
LR = 1e-2
POOL = 8  # distinct global batches, cycled through
CHECK_STEPS = 5
CHECK_ATOL = 1e-5
Step = Callable[[], None]


@dataclass(frozen=True)
class DpResult:
    """One N: the three step times and the communication of one step."""

    world_size: int
    shardwise_s: float  # per step, median of the repetitions, max over ranks
    ddp_s: float
    single_s: float
    single_threads: int
    diff_ddp: float  # max |shardwise - DDP| over every parameter element and rank
    diff_single: float  # max |shardwise - one process| (rank 0's parameters)
    recorded_bytes: float  # per rank per step, CommRecorder (rank 0; every rank sends alike)
    theory_bytes: float  # 2(N-1)/N * (param bytes + counts + two 4-byte loss all-reduces)
    param_bytes: int
    count_bytes: int  # the reducer's 3 counts per parameter (which ranks hold a gradient)
    collectives: int  # shardwise collectives per step (CommRecorder)
    phases: str  # the step's collectives in order, e.g. "AllReduce(forward)[1] ..."
    ddp_buckets: int | None  # DDP all-reduces per step (its logging data), None if unknown
    lo_shardwise_bytes: float | None  # measured loopback bytes per rank per step
    lo_ddp_bytes: float | None
    steps_per_call: int
    reps: int
    oversubscribed: bool

    @property
    def equal(self) -> bool:
        """Whether shardwise's parameters matched DDP's and one process's after the check."""
        return self.diff_ddp <= CHECK_ATOL and self.diff_single <= CHECK_ATOL


# --------------------------------------------------------------------------- the worker


def make_net() -> nn.Module:
    """The seed's MLP, with the same initial weights on every call (seeded)."""
    import torch
    from torch import nn

    torch.manual_seed(1)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """`POOL` synthetic global batches (images ~ N(0, 1), labels 0..9), equal on every rank."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(POOL, GLOBAL_BATCH, 1, 28, 28, generator=g)
    return x, torch.randint(0, 10, (POOL, GLOBAL_BATCH), generator=g)


def _rows(n: int, rank: int) -> slice:
    """This rank's rows of a global batch."""
    return slice(rank * GLOBAL_BATCH // n, (rank + 1) * GLOBAL_BATCH // n)


def _trainer(
    net: nn.Module, step_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: slice, after_backward: Step | None = None,
) -> Step:  # fmt: skip
    """One training step per call on rows `rows` of the next global batch."""
    import torch

    x, y = _data()
    opt = torch.optim.SGD(net.parameters(), LR)
    counter = itertools.count()

    def step() -> None:
        i = next(counter) % POOL
        opt.zero_grad(set_to_none=True)
        step_loss(x[i, rows], y[i, rows]).backward()
        if after_backward is not None:
            after_backward()
        opt.step()

    return step


def shardwise_step(n: int, rank: int) -> tuple[nn.Module, Step]:
    """Seed 004's step: all-reduced mean loss, backward, DistributedGradReducer, SGD."""
    import torch.nn.functional as F

    import shardwise as sw

    net, all_reduce = make_net(), sw.ops.AllReduce()
    reducer = sw.nn.DistributedGradReducer(net.parameters())

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = all_reduce(F.cross_entropy(net(x), y)) / n
        return out

    def reduce_grads() -> None:
        reducer()

    return net, _trainer(net, loss, _rows(n, rank), reduce_grads)


def ddp_step(n: int, rank: int) -> tuple[DistributedDataParallel, Step]:
    """What a PyTorch user writes: DDP around the net, plain cross entropy on the local rows."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_net())
    return ddp, _trainer(ddp, lambda x, y: F.cross_entropy(ddp(x), y), _rows(n, rank))


def single_step() -> tuple[nn.Module, Step]:
    """One process on the whole global batch."""
    import torch.nn.functional as F

    net = make_net()
    return net, _trainer(net, lambda x, y: F.cross_entropy(net(x), y), slice(None))


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).abs().max()) for p, q in pairs)


def _check(n: int, rank: int) -> tuple[float, float]:
    """Fresh shardwise / DDP / one-process nets, `CHECK_STEPS` steps each: max parameter
    differences (shardwise vs DDP on every rank; vs one process on rank 0), max over ranks."""
    import torch
    import torch.distributed as dist

    (sw_net, sw), (ddp_net, ddp) = shardwise_step(n, rank), ddp_step(n, rank)
    single_net, single = single_step()
    for _ in range(CHECK_STEPS):
        sw(), ddp()
        if rank == 0:
            single()
    diffs = torch.tensor([_max_diff(sw_net, ddp_net.module), 0.0], dtype=torch.float64)
    if rank == 0:
        diffs[1] = _max_diff(sw_net, single_net)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return float(diffs[0]), float(diffs[1])


def _accounting(sw: Step) -> tuple[int, int, str]:
    """One shardwise step under `CommRecorder`: (collectives, bytes per rank, each call)."""
    from shardwise.communication import CommRecorder

    with CommRecorder() as rec:
        sw()
    phases = " ".join(f"{r.kind}({r.phase})[{r.numel}]" for r in rec.records)
    return rec.count(), rec.total_bytes(), phases


def _ddp_buckets(ddp: DistributedDataParallel) -> int | None:
    """All-reduces per DDP step: its (private) logging data's ``num_buckets_reduced``."""
    try:
        return int(ddp._get_ddp_logging_data()["num_buckets_reduced"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def worker(args: dict[str, Any]) -> dict[str, Any] | None:
    """Check, account, then time the three candidates on this job's N ranks (rank 0 returns)."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    diff_ddp, diff_single = _check(n, rank)
    (_, sw), (ddp_net, ddp) = shardwise_step(n, rank), ddp_step(n, rank)
    _, single = single_step()
    steps, reps = (2, 2) if args["quick"] else (10, 9)
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        sw(), ddp()
    collectives, recorded, phases = _accounting(sw)
    threads = common.fastest_threads(single, rank, 3 if args["quick"] else 20)
    candidates = {
        "shardwise": chunk(sw, steps),
        "DDP": chunk(ddp, steps),
        "one process": chunk(single, steps, threads) if rank == 0 else lambda: None,
    }
    m = compare(candidates, iters=1, reps=reps, warmup=1, barrier=harness.barrier_bytes())
    if rank != 0:
        return None
    params = list(make_net().parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    count_bytes = sum(3 * p.element_size() for p in params)  # (in the bucket's dtype)
    lo = {k: v.median_lo_bytes for k, v in m.items()}
    return asdict(
        DpResult(
            world_size=n,
            shardwise_s=m["shardwise"].median_s / steps,
            ddp_s=m["DDP"].median_s / steps,
            single_s=m["one process"].median_s / steps,
            single_threads=threads,
            diff_ddp=diff_ddp,
            diff_single=diff_single,
            recorded_bytes=recorded,
            theory_bytes=2 * (n - 1) / n * (param_bytes + count_bytes + 2 * 4),
            param_bytes=param_bytes,
            count_bytes=count_bytes,
            collectives=collectives,
            phases=phases,
            ddp_buckets=_ddp_buckets(ddp_net),
            lo_shardwise_bytes=None if lo["shardwise"] is None else lo["shardwise"] / steps,
            lo_ddp_bytes=None if lo["DDP"] is None else lo["DDP"] / steps,
            steps_per_call=steps,
            reps=reps,
            oversubscribed=n > (os.cpu_count() or 1),
        )
    )


# --------------------------------------------------------------------------- the parent


def time_table(rows: list[DpResult]) -> Table:
    """Step times and ratios, one line per N."""
    t = Table(
        f"Manual data parallel, MNIST MLP, global batch {GLOBAL_BATCH}: time per training step",
        ["N", "rows/rank", "shardwise ms", "DDP ms", "one process ms", "sw/DDP", "sw/one",
         "DDP/one", "params sw = DDP = one (max |diff|)"],
    )  # fmt: skip
    for r in rows:
        worst = max(r.diff_ddp, r.diff_single)
        t.rows.append(
            [n_label(r), str(GLOBAL_BATCH // r.world_size), fmt_ms(r.shardwise_s), fmt_ms(r.ddp_s),
             f"{fmt_ms(r.single_s)} ({r.single_threads}t)", f"{r.shardwise_s / r.ddp_s:.2f}",
             f"{r.shardwise_s / r.single_s:.2f}", f"{r.ddp_s / r.single_s:.2f}",
             f"{'yes' if r.equal else 'NO'} ({worst:.1e})"]
        )  # fmt: skip
    return t


def comm_table(rows: list[DpResult]) -> Table:
    """Bytes and collectives per step per rank, one line per N."""
    t = Table(
        "Manual data parallel: communication per step per rank",
        ["N", "recorded sw", "theory", "lo sw", "lo DDP", "colls sw", "colls DDP",
         "shardwise collectives in order: kind(phase)[elements]"],
    )  # fmt: skip
    for r in rows:
        t.rows.append(
            [n_label(r), fmt_bytes(r.recorded_bytes), fmt_bytes(r.theory_bytes),
             fmt_bytes(r.lo_shardwise_bytes), fmt_bytes(r.lo_ddp_bytes), str(r.collectives),
             "n/a" if r.ddp_buckets is None else str(r.ddp_buckets), r.phases]
        )  # fmt: skip
    return t


def _notes(rows: list[DpResult], cores: int) -> list[str]:
    r0 = rows[0]
    notes = [
        f"ms: per step (forward + backward + SGD step), median of {r0.reps} repetitions of "
        f"{r0.steps_per_call} steps, max over ranks; the three alternate within one job. "
        "sw/DDP > 1: shardwise slower. one process: rank 0 alone on all 32 rows, (kt) = the "
        "faster of 1 thread and all cores; each DP rank runs 1 torch thread per core share",
        f"params: fresh copies trained {CHECK_STEPS} steps on the same batches; yes = every "
        f"element within {CHECK_ATOL:g}",
        f"theory: 2(N-1)/N x ({r0.param_bytes} parameter bytes + {r0.count_bytes} bytes of "
        "DistributedGradReducer's counts, 3 a parameter: which ranks hold a gradient, so "
        "that a gradient None on some ranks only is summed as zeros) + the forward and "
        "backward all-reduce of the 4-byte loss; recorded = CommRecorder (the same bound, so "
        "equal by construction); lo = measured loopback bytes per rank per step (TCP/IP "
        "headers and gloo control messages included, the framing barriers subtracted)",
        "colls sw: CommRecorder's count: the loss all-reduce, its backward, then "
        "DistributedGradReducer's one fused bucket after backward (outside autograd, so filed "
        "under 'forward'); colls DDP: num_buckets_reduced from DDP's logging data (1 MiB first "
        "bucket, then up to 25 MiB), each launched during backward once its gradients are ready",
    ]
    return notes + common.oversubscribed_notes(rows, cores)


def ranks_for(config: BenchConfig) -> tuple[int, ...]:
    """N = 2, 4 for the default ``--ranks``; otherwise ``--ranks`` (each must divide 32)."""
    why = f"manual_dp: --ranks {{bad}} do not divide the global batch {GLOBAL_BATCH}"
    return common.ranks_for(config, lambda n: GLOBAL_BATCH % n != 0, why)


def run(config: BenchConfig) -> str:
    """Spawn one job per N, print and save the two tables; return the printed text."""
    jobs = common.jobs("manual_dp", config, ranks_for(config), {"quick": config.quick})
    rows = [DpResult(**got[0]) for _, got in jobs]
    comm = comm_table(rows)
    comm.notes = _notes(rows, os.cpu_count() or 1)
    text = f"{time_table(rows)}\n\n{comm}"
    data = {
        "meta": common.report_meta(config, lr=LR, global_batch=GLOBAL_BATCH),
        "rows": [{**asdict(r), "equal": r.equal, "sw_over_ddp": r.shardwise_s / r.ddp_s,
                  "sw_over_single": r.shardwise_s / r.single_s} for r in rows],
    }  # fmt: skip
    harness.save_report(config.out_dir, "manual_dp", data, text)
    return text
