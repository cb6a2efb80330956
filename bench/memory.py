"""The memory model against real ranks: `report.estimate_memory` / `step_traffic` vs measured.

One gloo job of `RANKS` workers (4) runs `worker`, which for each network of `NETWORKS` and
each hsdp level of `LEVELS` (9 cases, one after the other in the same processes):

1. builds the network, its optimizer and ``sw.AutoParallel(...).hsdp(threshold=0,
   optimizer_level=L)`` inside a `report.MemoryMeter` (torch's CPU allocator, through
   ``torch.profiler``'s memory events; not RSS), and runs `STEPS` training steps, the last one
   inside the meter's window ``"step"`` and a `CommRecorder`;
2. returns, per rank, the estimate of the plan the wrapper runs (`estimate_memory` of
   ``parallel_plan`` / ``optimizer_plan`` with the optimizer's state per element; `step_traffic`)
   and what the step measured: the allocator's peak within the step, the bytes held when it
   began, and the recorder's bytes sent; and the pool of message buffers after the step
   (`communication.pooled_bytes`) against the model's ("pooled message buffers" of
   `memory_tensors`).

The networks (`build_case`): ``seed003``: ``examples/operator_parallel.py``'s Network
(MatMul / ReLU with the tutorial's strategies scaled to 4 devices) on a global batch of 32
MNIST-shaped images, SGD; ``gpt_block``: ``testing.models.GPTBlock`` with the Megatron
strategies on a 2 x 2 grid, Adam; ``gpt2``: ``testing.nanogpt.GPT2`` (``examples/gpt2.py``'s
tiny size), data parallel, nanoGPT's AdamW groups.

`run` prints the estimate-vs-measured table and saves ``memory.json`` / ``memory.txt``.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench import _common as common
from bench.harness import BenchConfig, Table, fmt_bytes, save_report, spawn

if TYPE_CHECKING:
    import torch

RANKS = 4
NETWORKS = ("seed003", "gpt_block", "gpt2")
LEVELS = ("level1", "level2", "level3")
STEPS = 3  # the last one is measured (the optimizer's state exists from the first)
Step = Callable[[], Any]


def _seed003(rank: int, n: int) -> tuple[Any, torch.optim.Optimizer, Step]:
    import importlib.util

    import torch

    import shardwise as sw
    from bench.harness import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "operator_parallel", REPO_ROOT / "examples" / "operator_parallel.py"
    )
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    sw.set_seed(1)
    net = ex.Network(ex.strategies(n))
    opt = torch.optim.SGD(net.parameters(), 1e-2)
    g = torch.Generator().manual_seed(rank)
    image = torch.randn(32 // n, 1, 28, 28, generator=g)
    label = torch.randint(0, 10, (32 // n,), generator=g)
    parallel = sw.AutoParallel(net, parallel_mode="semi_auto")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        loss = sw.ops.AllReduce()(loss_fn(parallel(image), label)) / n
        loss.backward()
        opt.step()
        opt.zero_grad()

    return parallel, opt, step


def _train_step_case(
    net: torch.nn.Module, opt: torch.optim.Optimizer, inputs: tuple[Any, ...], loss_of: Any
) -> tuple[Any, Step]:
    import shardwise as sw

    def train_step(*args: Any) -> Any:
        loss = loss_of(net, *args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    parallel = sw.AutoParallel(train_step, parallel_mode="semi_auto")
    return parallel, lambda: parallel(*inputs)


def _gpt_block(rank: int, n: int) -> tuple[Any, torch.optim.Optimizer, Step]:
    import torch

    from shardwise.testing.models import GPTBlock, GPTConfig, gpt_batches, megatron_strategies

    cfg = GPTConfig(vocab=256, seq=32, hidden=128, heads=4, ffn=512, keep_prob=1.0)
    torch.manual_seed(0)
    net = GPTBlock(cfg, megatron_strategies(2, n // 2))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    ids, onehot = gpt_batches(cfg, 8, 1)[0]  # (the global batch; this rank's rows)
    b, t = ids.shape[0] // n, onehot.shape[0] // n
    ids, onehot = ids[rank * b : (rank + 1) * b], onehot[rank * t : (rank + 1) * t]
    parallel, step = _train_step_case(net, opt, (ids, onehot), lambda m, i, t: m(i, t))
    return parallel, opt, step


def _gpt2(rank: int, n: int) -> tuple[Any, torch.optim.Optimizer, Step]:
    import torch

    from shardwise.testing.nanogpt import GPT2

    torch.manual_seed(0)
    net = GPT2(n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=64)
    opt = net.configure_optimizers(weight_decay=0.1, lr=6e-4)
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, 512, (2, 65), generator=g)
    inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def loss_of(m: Any, idx: Any, targets: Any) -> Any:
        return m(idx, targets)[1]

    parallel, step = _train_step_case(net, opt, inputs, loss_of)
    return parallel, opt, step


BUILDERS = {"seed003": _seed003, "gpt_block": _gpt_block, "gpt2": _gpt2}


def measure_case(network: str, level: str, rank: int, n: int) -> dict[str, Any]:
    """One case on this rank: the estimate and the measured peak and bytes (see the module
    docstring)."""
    from shardwise.communication import pooled_bytes, release_buffers
    from shardwise.report import MemoryMeter
    from shardwise.report._summary import (
        estimate_memory,
        memory_tensors,
        optimizer_state_per_element,
        step_traffic,
    )
    from shardwise.testing import CommRecorder

    release_buffers()  # (the pool of message buffers the previous case left: a fresh job's)
    with MemoryMeter() as meter:
        parallel, opt, step = BUILDERS[network](rank, n)
        parallel.hsdp(threshold=0, optimizer_level=level)
        for _ in range(STEPS - 1):
            step()
        gc.collect()  # (the network's whole weights, cut to shards, may wait in a cycle)
        with meter.window("step"), CommRecorder() as rec:
            step()
    pool_measured = pooled_bytes()  # (every message of the step finished: all given back)
    plan, opt_plan = parallel.parallel_plan, parallel.optimizer_plan
    k = optimizer_state_per_element(opt)
    est = estimate_memory(plan, opt_plan, k, rank)
    pooled = [t for t in memory_tensors(plan, opt_plan, k) if t.name == "pooled message buffers"]
    out = {
        "network": network,
        "level": level,
        "rank": rank,
        "estimate": dict(est.parts),
        "estimate_peak": est.peak,
        "moment": est.moment,
        "measured_peak": meter.peak("step"),
        "held_before": meter.held_at("step"),
        "sent_estimate": step_traffic(plan, rank, opt_plan).total,
        "sent_measured": rec.total_bytes(),
        "pool_estimate": sum(t.nbytes for t in pooled),
        "pool_measured": pool_measured,
    }
    parallel.remove()
    del parallel, opt, step, meter
    gc.collect()
    return out


def worker(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of `args` (``networks``, ``levels``) on this rank."""
    import torch.distributed as dist

    atexit.register(common.exit_quietly)
    n, rank = dist.get_world_size(), dist.get_rank()
    return [
        measure_case(net, level, rank, n)
        for net in args.get("networks", NETWORKS)
        for level in args.get("levels", LEVELS)
    ]


def run(config: BenchConfig) -> str:
    """One job of `RANKS` workers for every case; print rank 0's figures and the worst
    estimate / measured ratio over the ranks; save ``memory.json`` / ``memory.txt``."""
    got = spawn("bench.memory:worker", RANKS, {}, config.timeout_s)
    t = Table(
        f"Estimate vs measured, {RANKS} real gloo ranks (rank 0; ratio: worst over the ranks)",
        ["network", "level", "peak at", "est peak", "measured", "est/meas", "sent est", "sent",
         "sent ratio"],
    )  # fmt: skip
    for case in got[0]:
        same = [r for rows in got for r in rows if r["network"] == case["network"]]
        same = [r for r in same if r["level"] == case["level"]]
        ratios = [r["estimate_peak"] / r["measured_peak"] for r in same]
        sent = [r["sent_estimate"] / max(1, r["sent_measured"]) for r in same]
        t.rows.append(
            [
                case["network"],
                case["level"],
                case["moment"],
                fmt_bytes(case["estimate_peak"]),
                fmt_bytes(case["measured_peak"]),
                f"{max(ratios, key=lambda x: abs(x - 1)):.3f}",
                str(case["sent_estimate"]),
                str(case["sent_measured"]),
                f"{max(sent, key=lambda x: abs(x - 1)):.5f}",
            ]
        )
    t.notes.append(
        "peak: the most bytes torch's CPU allocator holds during the third training step "
        "(report.MemoryMeter, from before the network is built); sent: CommRecorder's bytes "
        "of that step (the script's own loss AllReduce, outside the plan, is the difference)"
    )
    text = str(t)
    save_report(config.out_dir, "memory", {"rows": got}, text)
    return text
