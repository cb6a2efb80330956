"""The automatic planners' plans against the ones users write, by plan cost and step time.

Per N (gloo ranks, each passing its rows of the global batch), in one job, alternating:

- nanoGPT's GPT-2 (`tests/zoo.py`) at two shapes: a large batch with a small hidden size, and a
  small batch (one sequence per rank) with a large hidden size. Candidates: pure data parallel
  (semi_auto, no annotation), a hand-written Megatron plan (semi_auto with ``sw.shard`` column /
  row parallel on every block's linears, mp = N) and the searched plan
  (``parallel_mode="recursive_programming"``, no annotation).
- seed 002's network with its first MatMul annotated (scaled to N): sharding propagation
  against the search.

Each candidate trains with AdamW (SGD for seed 002) in the train-step form; printed: the plan's
forward cost by the planners' model (`planner.plan_cost`, what the search minimizes), its
training-step estimate (`planner.step_cost`: communication / compute / optimizer), the
measured seconds and process CPU seconds per step (max over ranks, median of repetitions),
the seconds the busiest rank's main thread waited for a core (other processes' load), the ratio
of the step estimate to the measured step, the collectives per step (estimated and recorded) and
the planning seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import harness
from bench.harness import BenchConfig, Table

SHAPES = {
    "batch": ({"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 32}, 64),
    "hidden": ({"n_layer": 2, "n_embd": 512, "n_head": 8, "vocab_size": 256, "block_size": 32}, 0),
}
QUICK = {
    "batch": ({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 8}, 16),
    "hidden": ({"n_layer": 1, "n_embd": 128, "n_head": 2, "vocab_size": 64, "block_size": 8}, 0),
}


@dataclass
class PlanRow:
    world_size: int
    case: str
    candidate: str
    cost_s: float
    comm_s: float
    compute_s: float
    memory_s: float
    step_s: float
    step_comm_s: float
    step_compute_s: float
    step_optimizer_s: float
    step_collectives: int
    measured_s: float
    cpu_s: float
    waited_s: float | None
    collectives: int
    plan_s: float
    matrix: str
    oversubscribed: bool


def _gpt2(sizes: dict[str, int], mode: str, mp: int) -> tuple[Any, Any]:
    import torch
    from tests.zoo import GPT2

    import shardwise as sw

    net = GPT2(**sizes)
    if mode == "megatron":
        for block in net.transformer.h:
            sw.shard(block.attn.c_attn, in_strategy=((1, 1), (mp, 1)))
            sw.shard(block.attn.c_proj, in_strategy=((1, mp), (1, mp)))
            sw.shard(block.mlp.c_fc, in_strategy=((1, 1), (mp, 1)))
            sw.shard(block.mlp.c_proj, in_strategy=((1, mp), (1, mp)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step(x: Any, y: Any) -> Any:
        loss = net(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel_mode = "recursive_programming" if mode == "searched" else "semi_auto"
    return net, sw.AutoParallel(step, parallel_mode=parallel_mode)


def _seed002(n: int, mode: str) -> Any:
    import torch
    import torch.nn.functional as F
    from tests.planner.test_propagate import Seed002

    import shardwise as sw

    net = Seed002(annotate=False)
    half = max(n // 2, 1)
    net.matmul.shard(((2, half), (half, 1)) if n > 2 else ((1, n), (n, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.1)

    def step(x: Any, y: Any) -> Any:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return sw.AutoParallel(step, parallel_mode=mode)


def _candidates(quick: bool, n: int, rank: int) -> list[tuple[str, str, Any, Any, Any]]:
    """(case, candidate, wrapper, x rows, y rows) for this rank."""
    import torch
    from tests.zoo import token_batches

    out = []
    for case, (sizes, batch) in (QUICK if quick else SHAPES).items():
        batch = batch or n
        ((x, y),) = token_batches(1, batch, sizes["block_size"], sizes["vocab_size"])
        rows = slice(rank * batch // n, (rank + 1) * batch // n)
        for mode in ("data parallel", "megatron", "searched"):
            _, parallel = _gpt2(sizes, mode, n)
            out.append((f"gpt2 {case}", mode, parallel, x[rows], y[rows]))
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(2 * n, 32, generator=g), torch.rand(2 * n, 16, generator=g)
    rows = slice(2 * rank, 2 * rank + 2)
    for mode in ("sharding_propagation", "recursive_programming"):
        out.append(("seed002", mode, _seed002(n, mode), x[rows], y[rows]))
    return out


def _run_queue_s() -> float | None:
    """Seconds this thread has waited for a core so far (Linux ``schedstat``), None if unknown."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _waiting(fn: Callable[[], None], waits: list[float]) -> Callable[[], None]:
    """`fn`, appending to `waits` the seconds each call spent waiting for a core."""

    def call() -> None:
        before = _run_queue_s()
        fn()
        after = _run_queue_s()
        if before is not None and after is not None:
            waits.append(after - before)

    return call


def worker(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Plan (timed), check, count and time every candidate on this job's N ranks."""
    import torch
    import torch.distributed as dist

    from shardwise.planner import plan_cost, step_cost
    from shardwise.testing import CommRecorder

    n, rank = dist.get_world_size(), dist.get_rank()
    quick = bool(args["quick"])
    found, steps, waits = [], {}, {}
    for case, mode, parallel, x, y in _candidates(quick, n, rank):
        started = time.perf_counter()
        parallel(x, y)  # (the first call plans)
        planned = time.perf_counter() - started
        with CommRecorder() as rec:
            parallel(x, y)
        plan = parallel.parallel_plan
        cost, step = plan_cost(plan), step_cost(plan)
        found.append((case, mode, cost, step, len(rec.records), planned, str(plan.matrix)))
        call = common.chunk(lambda p=parallel, a=x, b=y: p(a, b), 1 if quick else 3)
        waits[f"{case}/{mode}"] = []
        steps[f"{case}/{mode}"] = _waiting(call, waits[f"{case}/{mode}"])
    m = harness.compare(steps, iters=1, reps=2 if quick else 5, warmup=1)
    per = 1 if quick else 3
    waited = torch.tensor([statistics.median(w) / per if w else -1.0 for w in waits.values()])
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)  # (-1: no rank could read schedstat)
    wait_of = {k: v if v >= 0 else None for k, v in zip(waits, waited.tolist(), strict=True)}
    if rank != 0:
        return None
    return [
        asdict(
            PlanRow(
                n, case, mode, cost.total, cost.comm, cost.compute, cost.memory,
                step.total, step.comm, step.compute, step.optimizer, step.collectives,
                m[f"{case}/{mode}"].median_s / per, m[f"{case}/{mode}"].median_cpu_s / per,
                wait_of[f"{case}/{mode}"], colls, planned, matrix, n > (os.cpu_count() or 1),
            )
        )
        for case, mode, cost, step, colls, planned, matrix in found
    ]  # fmt: skip


def _split_ms(r: PlanRow) -> str:
    parts = "/".join(
        f"{v * 1e3:.1f}" for v in (r.step_comm_s, r.step_compute_s, r.step_optimizer_s)
    )
    return f"{r.step_s * 1e3:.1f} ({parts})"


def run(config: BenchConfig) -> str:
    """One job per N; print and save the table."""
    ranks = common.ranks_for(config, lambda n: 64 % n != 0, "N must divide 64: {bad}")
    started = time.monotonic()
    jobs = common.jobs("auto_plans", config, ranks, {"quick": config.quick})
    rows = [PlanRow(**r) for _, got in jobs for r in got[0]]
    table = Table(
        "Automatic plans: the model's step estimate against the measured step",
        ["N", "case", "candidate", "matrix", "forward us", "step ms (comm/compute/opt)",
         "measured ms", "CPU ms", "waited ms", "predicted/measured", "colls est/rec", "plan s"],
        [
            [
                common.n_label(r), r.case, r.candidate, r.matrix.removeprefix("DeviceMatrix"),
                f"{r.cost_s * 1e6:.0f}", _split_ms(r),
                f"{r.measured_s * 1e3:.2f}", f"{r.cpu_s * 1e3:.2f}",
                "n/a" if r.waited_s is None else f"{r.waited_s * 1e3:.1f}",
                common.ratio(r.step_s, r.measured_s),
                f"{r.step_collectives}/{r.collectives}", f"{r.plan_s:.1f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    table.notes = [
        "forward us: plan_cost (one forward, what the search minimizes); step ms: step_cost "
        "(forward + backward + gradient buckets + AdamW's update; seed 002 trains with SGD, "
        "cheaper); CPU ms: the busiest rank's process CPU per step; waited ms: the longest any "
        "rank's main thread waited for a core per step (other processes, or more ranks than "
        "cores)",
        *common.oversubscribed_notes(rows, os.cpu_count() or 1),
    ]
    text = str(table)
    data = {"meta": common.report_meta(config, seconds=time.monotonic() - started),
            "rows": [asdict(r) for r in rows]}  # fmt: skip
    harness.save_report(config.out_dir, "auto_plans", data, text)
    return text
