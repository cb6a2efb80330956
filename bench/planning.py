"""Planning time: capture and plan a GPT-2-style model (nanoGPT's architecture, `tests/zoo.py`)
of 48 layers built on the meta device, in one process with no process group.

Prints the number of torch-level ops and of aten ops the graph holds, and the seconds for the
model build (meta), the capture and the semi_auto plan, for a few device counts. The target is
capture + plan under 1 s for the 48-layer graph. `--quick`: 4 layers, small sizes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench import harness
from bench.harness import BenchConfig


def _model(quick: bool) -> tuple[Any, torch.Tensor]:
    from tests.zoo import GPT2  # (the models users bring, as the tests use them)

    sizes = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=512, block_size=64)
    if not quick:
        sizes = dict(n_layer=48, n_embd=768, n_head=12, vocab_size=50304, block_size=1024)
    with torch.device("meta"):
        net = GPT2(**sizes)
    batch = torch.zeros(64, sizes["block_size"], dtype=torch.long)
    return net, batch


def run(config: BenchConfig) -> str:
    """Build, capture and plan; print and save the table."""
    from shardwise.planner import capture, plan_semi_auto

    t0 = time.perf_counter()
    net, ids = _model(config.quick)
    built = time.perf_counter() - t0
    rows = []
    for device_num in (8, 64):
        t0 = time.perf_counter()
        graph = capture(net, ids, ids)
        t1 = time.perf_counter()
        plan = plan_semi_auto(graph, device_num)
        t2 = time.perf_counter()
        aten = sum(len(n.aten) for n in graph.nodes)
        rows.append(
            {
                "device_num": device_num,
                "ops": len(graph.nodes),
                "aten_ops": aten,
                "capture_s": t1 - t0,
                "plan_s": t2 - t1,
                "collectives": len(plan.collectives()),
            }
        )
    lines = [f"planning ({'quick' if config.quick else '48 layers'}; build on meta {built:.2f} s)"]
    lines.append("devices  ops  aten ops  capture s  plan s  total s  collectives")
    for r in rows:
        total = r["capture_s"] + r["plan_s"]
        lines.append(
            f"{r['device_num']:>7}  {r['ops']:>4}  {r['aten_ops']:>8}  {r['capture_s']:>9.3f}"
            f"  {r['plan_s']:>6.3f}  {total:>7.3f}  {r['collectives']:>11}"
        )
    text = "\n".join(lines)
    harness.save_report(config.out_dir, "planning", {"build_s": built, "rows": rows}, text)
    return text
