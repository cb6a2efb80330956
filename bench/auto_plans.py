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
cost by the planners' model (`planner.plan_cost`, with its communication / compute / memory
split), the measured seconds per step (max over ranks, median of repetitions), the ratio of
predicted to measured, the collectives per step and the planning seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
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
    measured_s: float
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


def worker(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Plan (timed), check, count and time every candidate on this job's N ranks."""
    import torch.distributed as dist

    from shardwise.planner import plan_cost
    from shardwise.testing import CommRecorder

    n, rank = dist.get_world_size(), dist.get_rank()
    quick = bool(args["quick"])
    found, steps = [], {}
    for case, mode, parallel, x, y in _candidates(quick, n, rank):
        started = time.perf_counter()
        parallel(x, y)  # (the first call plans)
        planned = time.perf_counter() - started
        with CommRecorder() as rec:
            parallel(x, y)
        plan = parallel.parallel_plan
        found.append((case, mode, plan_cost(plan), len(rec.records), planned, str(plan.matrix)))
        call = common.chunk(lambda p=parallel, a=x, b=y: p(a, b), 1 if quick else 3)
        steps[f"{case}/{mode}"] = call
    m = harness.compare(steps, iters=1, reps=2 if quick else 5, warmup=1)
    if rank != 0:
        return None
    per = 1 if quick else 3
    return [
        asdict(
            PlanRow(
                n, case, mode, cost.total, cost.comm, cost.compute, cost.memory,
                m[f"{case}/{mode}"].median_s / per, colls, planned, matrix,
                n > (os.cpu_count() or 1),
            )
        )
        for case, mode, cost, colls, planned, matrix in found
    ]  # fmt: skip


def _split_us(r: PlanRow) -> str:
    parts = "/".join(f"{v * 1e6:.0f}" for v in (r.comm_s, r.compute_s, r.memory_s))
    return f"{r.cost_s * 1e6:.0f} ({parts})"


def run(config: BenchConfig) -> str:
    """One job per N; print and save the table."""
    ranks = common.ranks_for(config, lambda n: 64 % n != 0, "N must divide 64: {bad}")
    started = time.monotonic()
    jobs = common.jobs("auto_plans", config, ranks, {"quick": config.quick})
    rows = [PlanRow(**r) for _, got in jobs for r in got[0]]
    table = Table(
        "Automatic plans: plan cost (model) against measured seconds per step",
        ["N", "case", "candidate", "matrix", "cost us (comm/compute/mem)", "measured ms",
         "predicted/measured", "colls/step", "plan s"],
        [
            [
                common.n_label(r), r.case, r.candidate, r.matrix,
                _split_us(r),
                f"{r.measured_s * 1e3:.2f}", common.ratio(r.cost_s, r.measured_s),
                str(r.collectives), f"{r.plan_s:.1f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    table.notes = common.oversubscribed_notes(rows, os.cpu_count() or 1)
    text = str(table)
    data = {"meta": common.report_meta(config, seconds=time.monotonic() - started),
            "rows": [asdict(r) for r in rows]}  # fmt: skip
    harness.save_report(config.out_dir, "auto_plans", data, text)
    return text
