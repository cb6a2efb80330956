"""Planning time: capture and plan GPT-2-style models (nanoGPT's architecture, `tests/zoo.py`)
built on the meta device, in one process with no process group.

- `_semi_auto_rows`: 48 and 96 layers (1,018 and 2,026 torch-level ops), capture and the
  semi_auto plan for 8 and 64 devices (ops, aten ops, seconds).
- `_propagation_row`: a deep graph of about 10,000 torch-level ops (476 layers), sharding
  propagation with nothing annotated on 8 devices (one axis) and on a (2, 4) matrix: choosing
  the strategies and building the plan timed apart, cold and warm.
- `_search_rows`: GPT-2 small (12 layers), `plan_recursive_programming` for 8, 64 and 1,024
  devices (every device matrix of one or two axes tried; global batch: the larger of 64 and the
  device count, so that it splits).

- `_dry_run_row`: ``shardwise plan --device_num 1024 examples/gpt2.py --size small`` in a fresh
  process: wall time and peak RSS (the largest of this process's children so far: it is the
  only one).

`--quick`: small sizes (a twelfth of the layers, 64 hidden; search on 8 and 64 devices).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench import harness
from bench.harness import BenchConfig


def _model(quick: bool, n_layer: int = 48, batch: int = 64) -> tuple[Any, torch.Tensor]:
    from tests.zoo import GPT2  # (the models users bring, as the tests use them)

    sizes = dict(n_layer=max(2, n_layer // 12), n_embd=64, n_head=4, vocab_size=512, block_size=64)
    if not quick:
        sizes = dict(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50304, block_size=1024)
    with torch.device("meta"):
        net = GPT2(**sizes)
    ids = torch.zeros(batch, sizes["block_size"], dtype=torch.long)
    return net, ids


def _semi_auto_rows(net: Any, ids: torch.Tensor) -> list[dict[str, Any]]:
    from shardwise.planner import capture, plan_semi_auto

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
    return rows


def _propagation_row(quick: bool) -> dict[str, Any]:
    """Propagation (choosing every op's strategy: `propagate`) and building the plan from the
    choice (`build_plan`: layouts, redistributions, backward, explanations), each timed on
    its own, first (cold: DTensor's and SciPy's first use in the process) and again (warm)."""
    from shardwise.planner import capture
    from shardwise.planner._propagate import build_plan, propagate

    net, ids = _model(quick, n_layer=476)
    t0 = time.perf_counter()
    graph = capture(net, ids, ids)
    row: dict[str, Any] = {"ops": len(graph.nodes), "capture_s": time.perf_counter() - t0}
    for when in ("cold", "warm"):
        for label, extra in (("8", []), ("2x4", [(2, 4)])):
            t0 = time.perf_counter()
            run = propagate(graph, 8, extra_matrices=extra)
            t1 = time.perf_counter()
            build_plan(graph, run)
            row[f"propagate_{label}_{when}_s"] = t1 - t0
            row[f"build_{label}_{when}_s"] = time.perf_counter() - t1
    return row


def _search_rows(quick: bool) -> list[dict[str, Any]]:
    from shardwise.planner import capture
    from shardwise.planner._search import search

    rows = []
    for device_num in (8, 64) if quick else (8, 64, 1024):
        net, ids = _model(quick, n_layer=12, batch=max(64, device_num))
        graph = capture(net, ids, ids)
        t0 = time.perf_counter()
        try:
            matrices = len(search(graph, device_num).totals)
        except ValueError as e:  # (a planner bug at this size: reported, not hidden)
            matrices, error = 0, str(e)
        else:
            error = ""
        secs = time.perf_counter() - t0
        rows.append(
            {
                "device_num": device_num,
                "ops": len(graph.nodes),
                "matrices": matrices,
                "search_s": secs,
                "error": error,
            }
        )
    return rows


def _dry_run_row(quick: bool) -> dict[str, Any]:
    """``shardwise plan --device_num 1024 examples/gpt2.py --size small`` (GPT-2 small; tiny
    with ``--quick``) as a user runs it: a fresh process, its wall time and peak RSS."""
    import os
    import subprocess
    import sys
    import tempfile

    size = "tiny" if quick else "small"
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shardwise", "plan", "--device_num", "1024", "--out", out]
        cmd += ["examples/gpt2.py", "--size", size]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # (this child's own usage: RUSAGE_CHILDREN sums every child the bench ever waited for,
        # the earlier benchmarks' workers too, and gives the largest RSS of any of them)
        _, status, usage = os.wait4(child.pid, 0)
        secs = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
    return {
        "size": size,
        "wall_s": secs,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "rc": child.returncode,
    }


def run(config: BenchConfig) -> str:
    """Build, capture and plan; print and save the tables."""
    t0 = time.perf_counter()
    net, ids = _model(config.quick)
    built = time.perf_counter() - t0
    layers = [max(2, n // 12) if config.quick else n for n in (48, 96)]  # (as `_model` builds)
    rows = [{"layers": layers[0], **r} for r in _semi_auto_rows(net, ids)]
    del net
    deep = _model(config.quick, n_layer=96)
    rows += [{"layers": layers[1], **r} for r in _semi_auto_rows(*deep)]
    prop = _propagation_row(config.quick)
    searched = _search_rows(config.quick)
    dry = _dry_run_row(config.quick)
    size = "quick: a twelfth of the layers" if config.quick else "48 layers"
    lines = [f"planning ({size}; build on meta {built:.2f} s)"]
    lines.append("layers  devices   ops  aten ops  capture s  plan s  total s  collectives")
    for r in rows:
        total = r["capture_s"] + r["plan_s"]
        lines.append(
            f"{r['layers']:>6}  {r['device_num']:>7}  {r['ops']:>4}  {r['aten_ops']:>8}"
            f"  {r['capture_s']:>9.3f}  {r['plan_s']:>6.3f}  {total:>7.3f}  {r['collectives']:>11}"
        )
    lines.append(f"propagation, {prop['ops']} ops (capture {prop['capture_s']:.2f} s):")
    for label, name in (("8", "8 devices"), ("2x4", "(2, 4)   ")):
        lines.append(
            f"  {name}  propagate {prop[f'propagate_{label}_cold_s']:.2f} s cold, "
            f"{prop[f'propagate_{label}_warm_s']:.2f} s warm; build the plan "
            f"{prop[f'build_{label}_cold_s']:.2f} / {prop[f'build_{label}_warm_s']:.2f} s"
        )
    lines.append("search (12 layers)  devices  ops  matrices  search s")
    for r in searched:
        lines.append(
            f"{'':>19}  {r['device_num']:>7}  {r['ops']:>3}  {r['matrices']:>8}"
            f"  {r['search_s']:>8.2f}  {r['error'][:60]}"
        )
    lines.append(
        f"shardwise plan --device_num 1024 examples/gpt2.py --size {dry['size']}: "
        f"{dry['wall_s']:.2f} s wall ({dry['cpu_s']:.2f} s CPU), peak RSS "
        f"{dry['peak_rss_mb']:.0f} MB (exit {dry['rc']})"
    )
    text = "\n".join(lines)
    data = {
        "build_s": built,
        "rows": rows,
        "propagation": prop,
        "search": searched,
        "dry_run": dry,
    }
    harness.save_report(config.out_dir, "planning", data, text)
    return text
