"""nanoGPT's GPT-2 (`tests/zoo.py`) in semi_auto with no annotation against DDP, side by side.

Each of N gloo ranks trains the same model on its rows of a global batch: shardwise
(``sw.AutoParallel(train_step, parallel_mode="semi_auto")``: capture, plan, run the plan) and
what a PyTorch user writes (``DistributedDataParallel`` around the model), both with AdamW.
A third candidate is the DDP step that also returns what shardwise's returns, the loss of the
global batch on every rank (DDP's loss is this rank's rows only): the same step followed by
an AllReduce of the loss. Printed per N: seconds per step (max over ranks, median of
repetitions), the ratios shardwise / DDP and shardwise / DDP with the loss's AllReduce (the
median of the paired repetitions' ratios with its 95 % confidence interval), CPU
seconds per step, the collectives per step and the largest parameter difference after the
check steps (shardwise vs DDP: the same training), and the difference of the next step's
returned loss between shardwise and DDP with the loss's AllReduce.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench import _common as common
from bench import harness
from bench.harness import BenchConfig, Table

SIZES = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 512, "block_size": 64}
QUICK = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 16}
GLOBAL_BATCH = 16
HEADER = ["N", "shardwise s", "DDP s", "ratio", "DDP+loss s", "ratio"]
HEADER += ["sw CPU s", "DDP CPU s", "colls/step", "max diff", "loss diff"]


@dataclass
class Gpt2Result:
    world_size: int
    shardwise_s: float
    ddp_s: float
    ddp_loss_s: float
    shardwise_cpu_s: float
    ddp_cpu_s: float
    collectives: int
    max_diff: float
    loss_diff: float
    oversubscribed: bool
    ratio: list[float | None]  # shardwise / DDP, paired: median, 95 % bounds
    ratio_loss: list[float | None]  # shardwise / DDP+loss, the same


def _make(quick: bool) -> Any:
    from tests.zoo import GPT2

    return GPT2(**(QUICK if quick else SIZES))


def _batch(quick: bool, n: int, rank: int) -> tuple[Any, Any]:
    from tests.zoo import token_batches

    sizes = QUICK if quick else SIZES
    ((x, y),) = token_batches(1, GLOBAL_BATCH, sizes["block_size"], sizes["vocab_size"])
    rows = GLOBAL_BATCH // n
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def _steps(quick: bool, n: int, rank: int) -> tuple[Any, Any, Any, Any, Any]:
    """(shardwise net, its step, DDP module, its step, its step with the loss's AllReduce) on
    this rank's rows."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import shardwise as sw

    x, y = _batch(quick, n, rank)
    net = _make(quick)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def sw_train(a: Any, b: Any) -> Any:
        loss = net(a, b)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = sw.AutoParallel(sw_train, parallel_mode="semi_auto")
    ddp = DistributedDataParallel(_make(quick))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_train() -> Any:
        loss = ddp(x, y)[1]
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        return loss

    def ddp_loss_train() -> Any:  # (the global batch's loss on every rank, as shardwise's)
        loss = ddp_train().detach().clone()
        dist.all_reduce(loss)
        return loss / n

    return net, (lambda: parallel(x, y)), ddp, ddp_train, ddp_loss_train


def worker(args: dict[str, Any]) -> dict[str, Any] | None:
    """Check, count, then time both candidates on this job's N ranks (rank 0 returns)."""
    import torch.distributed as dist

    from shardwise.testing import CommRecorder

    n, rank = dist.get_world_size(), dist.get_rank()
    quick = bool(args["quick"])
    net, sw_step, ddp, ddp_step, ddp_loss_step = _steps(quick, n, rank)
    for _ in range(3):
        sw_step(), ddp_step()
    pairs = zip(net.parameters(), ddp.module.parameters(), strict=True)
    diff = max(float((p - q).abs().max()) for p, q in pairs)
    loss_diff = abs(float(sw_step()) - float(ddp_loss_step()))  # (the same step's returned loss)
    with CommRecorder() as rec:
        sw_step()
    steps, reps = (1, 2) if quick else (5, 31)
    m = harness.compare(
        {
            "shardwise": common.chunk(sw_step, steps),
            "DDP": common.chunk(ddp_step, steps),
            "DDP + loss": common.chunk(ddp_loss_step, steps),
        },
        iters=1,
        reps=reps,
        warmup=1,
    )
    if rank != 0:
        return None
    ratios = [harness.paired_ratio(m["shardwise"], m[other]) for other in ("DDP", "DDP + loss")]
    return asdict(
        Gpt2Result(
            world_size=n,
            shardwise_s=m["shardwise"].median_s / steps,
            ddp_s=m["DDP"].median_s / steps,
            ddp_loss_s=m["DDP + loss"].median_s / steps,
            shardwise_cpu_s=m["shardwise"].median_cpu_s / steps,
            ddp_cpu_s=m["DDP"].median_cpu_s / steps,
            collectives=len(rec.records),
            max_diff=diff,
            loss_diff=loss_diff,
            oversubscribed=n > (os.cpu_count() or 1),
            ratio=[ratios[0].median, ratios[0].low, ratios[0].high],
            ratio_loss=[ratios[1].median, ratios[1].low, ratios[1].high],
        )
    )


def run(config: BenchConfig) -> str:
    """One job per N; print and save the table."""
    ranks = common.ranks_for(config, lambda n: GLOBAL_BATCH % n != 0, "N must divide 16: {bad}")
    started = time.monotonic()
    jobs = common.jobs("gpt2_semi_auto", config, ranks, {"quick": config.quick})
    rows = [Gpt2Result(**got[0]) for _, got in jobs]
    table = Table(
        "GPT-2 (nanoGPT, semi_auto, no annotation) vs DDP: seconds per step",
        HEADER,
        [
            [
                common.n_label(r),
                f"{r.shardwise_s:.4f}",
                f"{r.ddp_s:.4f}",
                str(harness.Ratio(*r.ratio)),
                f"{r.ddp_loss_s:.4f}",
                str(harness.Ratio(*r.ratio_loss)),
                f"{r.shardwise_cpu_s:.4f}",
                f"{r.ddp_cpu_s:.4f}",
                str(r.collectives),
                f"{r.max_diff:.1e}",
                f"{r.loss_diff:.1e}",
            ]
            for r in rows
        ],
    )
    table.notes = [
        "DDP+loss: the DDP step, then an AllReduce of its loss (the global batch's loss on "
        "every rank, as shardwise returns)",
        "ratio: the median of the repetitions' ratios (each pair timed in one round) and its "
        "95 % confidence interval; an interval holding 1.00 cannot tell the two apart on this "
        "host",
        *common.oversubscribed_notes(rows, os.cpu_count() or 1),
    ]
    text = str(table)
    data = {"meta": common.report_meta(config, sizes=QUICK if config.quick else SIZES,
                                       global_batch=GLOBAL_BATCH,
                                       seconds=time.monotonic() - started),
            "rows": [asdict(r) for r in rows]}  # fmt: skip
    harness.save_report(config.out_dir, "gpt2_semi_auto", data, text)
    return text
