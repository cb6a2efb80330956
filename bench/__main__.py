"""``python -m bench``: run the benchmarks, print their tables, save them under ``--out``.

`parse_args` reads the options into a `BenchConfig`; `main` runs each selected benchmark of
`BENCHMARKS` (name -> ``run(config) -> printed text``) in order, prints its table and
writes ``<out>/<name>.json`` / ``<name>.txt`` (done by each benchmark's `run`) plus
``<out>/bench.txt`` with everything printed.

Examples:
    python -m bench                              # everything, N = 2, 4, 8
    python -m bench --only collectives --ranks 4 --sizes 1M
    python -m bench --quick --ranks 2 --collectives AllReduce,ReduceScatter
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from bench import (
    auto_plans,
    checkpoint_transform,
    collectives,
    dataloading,
    gpt2_semi_auto,
    gpt_block,
    loopback,
    manual_dp,
    memory,
    operator_parallel,
    optimizer_parallel,
    planning,
)
from bench.harness import BenchConfig, KiB, MiB, WorkerError, host_info

BENCHMARKS: dict[str, Callable[[BenchConfig], str]] = {
    "loopback": loopback.run,
    "collectives": collectives.run,
    "manual_dp": manual_dp.run,
    "dataloading": dataloading.run,
    "operator_parallel": operator_parallel.run,
    "gpt_block": gpt_block.run,
    "optimizer_parallel": optimizer_parallel.run,
    "memory": memory.run,
    "planning": planning.run,
    "gpt2_semi_auto": gpt2_semi_auto.run,
    "auto_plans": auto_plans.run,
    "checkpoint_transform": checkpoint_transform.run,
}
QUICK_SIZES = (4 * KiB,)
V = TypeVar("V")


def parse_size(text: str) -> int:
    """``64K`` / ``64KiB`` -> 65536, ``8M`` -> 8 MiB, ``4096`` -> 4096 (bytes)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": 1024 * MiB}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 64K, 1M, 4096") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is below one float32 (4 bytes)")
    return value


def _csv(convert: Callable[[str], V]) -> Callable[[str], tuple[V, ...]]:
    return lambda text: tuple(convert(p) for p in text.split(",") if p.strip())


def _benchmark(text: str) -> str:
    name = text.strip()
    if name not in BENCHMARKS:
        raise argparse.ArgumentTypeError(
            f"--only: unknown benchmark {name!r}; one of {sorted(BENCHMARKS)}"
        )
    return name


def _ranks(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"--ranks: {n} < 2 (a collective needs two ranks)")
    return n


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[str], BenchConfig]:
    """The benchmarks to run and their shared configuration."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description="Run the shardwise benchmarks, print and save them."
    )
    p.add_argument(
        "--only",
        type=_csv(_benchmark),
        help=f"comma-separated benchmarks to run (default all): {', '.join(BENCHMARKS)}",
    )
    p.add_argument("--ranks", type=_csv(_ranks), help="world sizes, default 2,4,8")
    p.add_argument("--sizes", type=_csv(parse_size), help="bytes per rank, default 64K,1M,8M")
    p.add_argument("--collectives", help="comma-separated subset, e.g. AllReduce,ReduceScatter")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations (smoke)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per worker job")
    p.add_argument(
        "--out", type=Path, help="results folder (bench/results; bench/results/quick if --quick)"
    )
    a = p.parse_args(argv)
    default = BenchConfig()
    config = BenchConfig(
        ranks=a.ranks or default.ranks,
        sizes=a.sizes or (QUICK_SIZES if a.quick else default.sizes),
        quick=a.quick,
        collectives=tuple(c.strip() for c in (a.collectives or "").split(",") if c.strip()),
        timeout_s=a.timeout,
        out_dir=a.out or (default.out_dir / "quick" if a.quick else default.out_dir),
    )
    return (list(a.only) if a.only else list(BENCHMARKS)), config


def _header(config: BenchConfig) -> str:
    info = host_info()
    cores = info["cpu_count"]
    line = (
        f"shardwise bench on {info['host']}: {cores} cores, torch {info['torch']}, gloo, "
        f"ranks {','.join(map(str, config.ranks))}{', quick' if config.quick else ''}"
    )
    load = info["loadavg_1min"]
    if load is not None and load > cores / 2:
        line += (
            f"\nnote: 1-minute load average {load:.2f} on {cores} cores: other processes are (or "
            "were just) busy; expect noisy times"
        )
    if max(config.ranks) > cores:
        line += (
            f"\nnote: N > {cores} workers oversubscribe the {cores} cores; their times include "
            "time-slicing and are never to be reported as speed-ups"
        )
    return line


def main(argv: Sequence[str] | None = None) -> int:
    names, config = parse_args(argv)
    start = time.monotonic()
    printed = [_header(config)]
    print(printed[0], flush=True)
    for name in names:
        try:
            text = BENCHMARKS[name](config)
        except (WorkerError, ValueError) as e:
            print(f"bench {name} failed: {e}", file=sys.stderr)
            return 1
        printed.append(text)
        print(f"\n{text}", flush=True)
    footer = f"\ntotal {time.monotonic() - start:.0f}s; results in {config.out_dir}"
    print(footer)
    (config.out_dir / "bench.txt").write_text("\n\n".join(printed) + "\n" + footer + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
