"""Checkpoint resharding: ``sw.checkpoint.transform`` against torch DCP, the same 8 -> 4 ranks.

The model is a stack of square ``nn.Linear`` weights (fp32; ``--quick``: a few small ones,
4 -> 2 ranks). Every weight's block on source rank r is ``randn`` seeded by (layer, r); the
blocks stacked along dim 0 are the weight. Both sides start from a checkpoint cut along dim 0
and end with the destination ranks holding the weights cut along dim 1 (every block changes):

- ``DCP``: the source's gloo ranks save their ``Shard(0)`` DTensors with ``dcp.save`` (not
  timed); then the destination's ranks ``dcp.load`` into ``Shard(1)`` DTensors (``load``),
  and save those with ``dcp.save`` (``load + save``: a new checkpoint, what transform writes).
- ``shardwise``: the same weights saved as a shardwise checkpoint of the source's ranks (one
  file, then transform; not timed), then one process runs ``sw.checkpoint.transform(src,
  dst, strategy_file)``.

Each timed side is a fresh job; it reports wall and CPU seconds (every process together) and
the peak RSS above its baseline after imports (``VmHWM``; DCP: summed over its ranks, whose
state dict is part of what a load needs). The DCP loaders also return the sum of their
blocks, which must equal the sums of shardwise's rank files (the same cut). Files are read
just after they were written (in the page cache on both sides).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchConfig, Table, host_info, save_report, spawn

MiB = 1 << 20
RANKS, QUICK_RANKS = (8, 4), (4, 2)  # (source ranks, destination ranks)


def _sizes(quick: bool) -> dict[str, int]:
    """32 weights 2048 x 2048 fp32 = 512 MiB, 8 -> 4 ranks; quick: 4 x 128 x 128, 4 -> 2."""
    (src, dst), (layers, width) = (QUICK_RANKS, (4, 128)) if quick else (RANKS, (32, 2048))
    return {"layers": layers, "width": width, "src_ranks": src, "dst_ranks": dst}


def _block(layer: int, rank: int, width: int, ranks: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(layer * 1000 + rank)
    return torch.randn(width // ranks, width, generator=g)


def _peak() -> int:
    """This process's peak RSS in bytes (``VmHWM``; 0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------- workers


def dcp_save(args: dict[str, Any]) -> None:
    """8 ranks: save this rank's ``Shard(0)`` blocks of every weight with ``dcp.save``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers, width = args["layers"], args["width"]
    state = {
        f"layers.{i}.weight": DTensor.from_local(
            _block(i, dist.get_rank(), width, dist.get_world_size()),
            mesh,
            [Shard(0)],
            run_check=False,
        )
        for i in range(layers)
    }
    dcp.save(state, checkpoint_id=args["dir"])


def dcp_reshard(args: dict[str, Any]) -> dict[str, Any]:
    """4 ranks: ``dcp.load`` the 8-rank checkpoint into ``Shard(1)`` DTensors, then save them."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers, width, n = args["layers"], args["width"], dist.get_world_size()
    dist.barrier()
    base, cpu0, t0 = _peak(), time.process_time(), time.perf_counter()
    state = {
        f"layers.{i}.weight": DTensor.from_local(
            torch.empty(width, width // n),
            mesh,
            [Shard(1)],
            run_check=False,
            shape=torch.Size((width, width)),
            stride=(width, 1),
        )
        for i in range(layers)
    }
    dcp.load(state, checkpoint_id=args["src"])
    dist.barrier()
    t1, cpu1, load_peak = time.perf_counter(), time.process_time(), _peak() - base
    dcp.save(state, checkpoint_id=args["dst"])
    dist.barrier()
    t2, cpu2 = time.perf_counter(), time.process_time()
    total = sum(float(t.to_local().double().sum()) for t in state.values())
    return {
        "load_s": t1 - t0,
        "save_s": t2 - t1,
        "load_cpu_s": cpu1 - cpu0,
        "save_cpu_s": cpu2 - cpu1,
        "load_peak_bytes": load_peak,
        "peak_bytes": _peak() - base,
        "sum": total,
    }


def sw_transform(args: dict[str, Any]) -> dict[str, Any]:
    """One process: ``sw.checkpoint.transform(src8, dst4, strategy_4)``."""
    import shardwise as sw

    base, cpu0, t0 = _peak(), time.process_time(), time.perf_counter()
    sw.checkpoint.transform(args["src"], args["dst"], args["strategy"], progress=False)
    wall, cpu, peak = time.perf_counter() - t0, time.process_time() - cpu0, _peak() - base
    sums = []  # (after the peak: these loads hold whole rank files)
    for r in range(args["dst_ranks"]):
        ck = sw.load_checkpoint(Path(args["dst"]) / f"rank_{r}" / "model.safetensors")
        sums.append(sum(float(t.double().sum()) for t in ck.values()))
    return {"wall_s": wall, "cpu_s": cpu, "peak_bytes": peak, "sums": sums}


# --------------------------------------------------------------------------- parent


def _split(n: int, names: list[str], width: int, dim: int) -> Any:
    """The shardwise strategy of `n` ranks holding every weight split along `dim`."""
    from shardwise.checkpoint import CheckpointStrategy
    from shardwise.layout import DeviceMatrix, TensorLayout
    from shardwise.planner import ParamPlan

    m = DeviceMatrix((n,), ("mp",))
    layout = TensorLayout(m, ((0,), ()) if dim == 0 else ((), (0,)))
    return CheckpointStrategy(n, m, {k: ParamPlan(layout, (width, width)) for k in names})


def _sw_source(root: Path, sizes: dict[str, int]) -> tuple[Path, Path]:
    """The source-rank shardwise checkpoint and the destination's strategy file."""
    import torch

    import shardwise as sw

    n, width = sizes["src_ranks"], sizes["width"]
    names = [f"layers.{i}.weight" for i in range(sizes["layers"])]
    whole = {k: torch.cat([_block(i, r, width, n) for r in range(n)]) for i, k in enumerate(names)}
    one = sw.save_checkpoint(whole, root / "model.safetensors")
    del whole
    src = sw.checkpoint.transform(one, root / "sw_src", _split(n, names, width, 0), progress=False)
    one.unlink()
    strategy = root / "strategy_dst.json"
    strategy.write_text(json.dumps(_split(sizes["dst_ranks"], names, width, 1).to_json()))
    return src, strategy


def _measure(config: BenchConfig, root: Path) -> dict[str, Any]:
    sizes, timeout = _sizes(config.quick), config.timeout_s
    layers, width = sizes["layers"], sizes["width"]
    spawn(
        "bench.checkpoint_transform:dcp_save",
        sizes["src_ranks"],
        {**sizes, "dir": str(root / "dcp_src")},
        timeout,
    )
    src, strategy = _sw_source(root, sizes)
    dcp = spawn(
        "bench.checkpoint_transform:dcp_reshard",
        sizes["dst_ranks"],
        {**sizes, "src": str(root / "dcp_src"), "dst": str(root / "dcp_dst")},
        timeout,
    )
    ours = spawn(
        "bench.checkpoint_transform:sw_transform",
        1,
        {
            "src": str(src),
            "dst": str(root / "sw_dst"),
            "strategy": str(strategy),
            "dst_ranks": sizes["dst_ranks"],
        },
        timeout,
    )[0]
    match = all(
        abs(d["sum"] - s) <= 1e-6 * max(1.0, abs(s)) for d, s in zip(dcp, ours["sums"], strict=True)
    )
    return {
        "model_bytes": layers * width * width * 4,
        **sizes,
        "dcp": dcp,
        "shardwise": ours,
        "match": match,
    }


def run(config: BenchConfig) -> str:
    """Build both source checkpoints, reshard each, print and save the table."""
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-ckpt-") as tmp:
        data = _measure(config, Path(tmp))
    size, n_src, n_dst = data["model_bytes"], data["src_ranks"], data["dst_ranks"]
    ours = data["shardwise"]
    table = Table(
        f"Checkpoint resharding {n_src} -> {n_dst} ranks: {data['layers']} weights "
        f"{data['width']}x{data['width']} fp32 = {size / MiB:.0f} MiB (dim 0 cut -> dim 1 cut)",
        ["side", "wall s", "CPU s", "MB/s", "peak RSS MiB", "shardwise MB/s ratio", "peak ratio"],
    )
    rows = []
    for side, wall, cpu, peak in (
        ("shardwise transform (1 process)", ours["wall_s"], ours["cpu_s"], ours["peak_bytes"]),
        *_dcp_sides(data["dcp"], n_dst),
    ):
        rate = size / MiB / wall
        rows.append(
            {"side": side, "wall_s": wall, "cpu_s": cpu, "mib_per_s": rate, "peak_bytes": peak}
        )
        table.rows.append(
            [
                side,
                f"{wall:.2f}",
                f"{cpu:.2f}",
                f"{rate:.3g}",
                f"{peak / MiB:.0f}",
                f"{rows[0]['mib_per_s'] / rate:.2f}",
                f"{rows[0]['peak_bytes'] / max(peak, 1):.2f}",
            ]
        )
    table.notes += _notes(data)
    text = str(table)
    save_report(
        config.out_dir,
        "checkpoint_transform",
        {"meta": {**host_info(), "quick": config.quick}, **data, "rows": rows},
        text,
    )
    return text


def _dcp_sides(dcp: list[dict[str, Any]], n: int) -> list[tuple[str, float, float, int]]:
    """(side, wall s: the slowest rank, CPU s and peak bytes: summed over the ranks)."""
    load = max(r["load_s"] for r in dcp)
    both = max(r["load_s"] + r["save_s"] for r in dcp)
    return [
        (
            f"DCP load ({n} ranks)",
            load,
            sum(r["load_cpu_s"] for r in dcp),
            sum(r["load_peak_bytes"] for r in dcp),
        ),
        (
            f"DCP load + save ({n} ranks)",
            both,
            sum(r["load_cpu_s"] + r["save_cpu_s"] for r in dcp),
            sum(r["peak_bytes"] for r in dcp),
        ),
    ]


def _notes(data: dict[str, Any]) -> list[str]:
    n_src, n_dst, cores = data["src_ranks"], data["dst_ranks"], os.cpu_count() or 1
    notes = [
        "MB/s: MiB of the model re-cut per wall second. ratios: shardwise / the row (MB/s "
        "above 1: shardwise faster; peak below 1: shardwise smaller).",
        f"DCP peak: the sum over its {n_dst} ranks of VmHWM above each one's baseline "
        "(its state dict, the loaded model, is part of it); shardwise: one process.",
        f"values equal on both sides (per-rank sums): {data['match']}",
    ]
    if n_dst > cores:
        notes.append(
            f"* {n_dst} DCP ranks on {cores} cores are time-sliced: compare CPU s too; "
            f"the {n_src}-rank save (not timed) oversubscribes even more"
        )
    return notes
