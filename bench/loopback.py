"""Loopback latency and bandwidth of gloo: a fitted cost model t = alpha + bytes * beta.

- `worker` (runs on 2 ranks): ping-pong with ``dist.send`` / ``dist.recv`` for message sizes
  8 B .. 16 MiB; the one-way time of a size is half the median of its timed round trips.
- `fit` : least squares of t = alpha + bytes * beta on those points, weighted by 1/t so that
  the 8-byte and the 16-MiB points count alike (relative residuals).
- `run` : spawns the workers, fits, prints a table and saves ``loopback.json``
  ({"alpha_s", "beta_s_per_byte", "backend": "gloo", "host", ...}) and ``loopback.txt``.
- `load_loopback_model` : reads ``loopback.json`` back as a `LoopbackModel` (cost models
  outside ``bench/`` read the same JSON keys directly).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    REPO_ROOT,
    BenchConfig,
    KiB,
    MiB,
    Table,
    fmt_bytes,
    host_info,
    save_report,
    spawn,
)

DEFAULT_PATH = REPO_ROOT / "bench" / "results" / "loopback.json"
SIZES = [8 * 4**k for k in range(11)] + [16 * MiB]  # 8 B, 32 B, ..., 8 MiB, 16 MiB
QUICK_SIZES = [8, 4 * KiB, 256 * KiB]


@dataclass(frozen=True)
class LoopbackModel:
    """t(bytes) = alpha_s + bytes * beta_s_per_byte for one point-to-point message."""

    alpha_s: float
    beta_s_per_byte: float
    backend: str = "gloo"
    host: str = ""

    @property
    def bandwidth_gbps(self) -> float:
        """1 / beta in GB/s (10^9 bytes per second)."""
        return 1.0 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")

    def seconds(self, nbytes: float) -> float:
        """Predicted one-way time of a message of `nbytes`."""
        return self.alpha_s + nbytes * self.beta_s_per_byte

    def __str__(self) -> str:
        return (
            f"{self.backend} loopback on {self.host or '?'}: alpha {self.alpha_s * 1e6:.1f} us, "
            f"bandwidth {self.bandwidth_gbps:.2f} GB/s"
        )


def load_loopback_model(path: Path | str = DEFAULT_PATH) -> LoopbackModel:
    """Read a `LoopbackModel` from ``loopback.json`` (written by ``python -m bench``).

    Raises:
        FileNotFoundError: no such file; run ``python -m bench --only loopback`` first.
    """
    data = json.loads(Path(path).read_text())
    return LoopbackModel(
        float(data["alpha_s"]),
        float(data["beta_s_per_byte"]),
        str(data.get("backend", "gloo")),
        str(data.get("host", "")),
    )


def _rounds(nbytes: int, quick: bool) -> int:
    """Timed round trips for one message size (after as many warm-up ones, at most 10)."""
    if quick:
        return 3
    return max(10, min(500, (64 * MiB) // max(nbytes, 1)))


def _round_trip(buf: Any, rank: int) -> float:
    import torch.distributed as dist

    start = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)
    return time.perf_counter() - start


def worker(args: dict[str, Any]) -> list[list[float]] | None:
    """Ping-pong between ranks 0 and 1; rank 0 returns [[bytes, p10 s, median s], ...] of the
    one-way time (half a round trip).

    Each round trip is timed on its own. The fit uses the 10th percentile: interference only
    ever adds time (a rank waiting for a core costs a scheduler tick, ~4 ms, when other
    processes keep the cores busy), so a low quantile is the transport's own cost.
    """
    import torch
    import torch.distributed as dist

    rank, points = dist.get_rank(), []
    for nbytes in args["sizes"]:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        rounds = _rounds(nbytes, args["quick"])
        dist.barrier()
        for _ in range(min(rounds, 10)):
            _round_trip(buf, rank)
        samples = sorted(_round_trip(buf, rank) / 2 for _ in range(rounds))
        points.append([float(nbytes), samples[len(samples) // 10], statistics.median(samples)])
    return points if rank == 0 else None


def fit(points: list[list[float]]) -> tuple[float, float]:
    """Weighted least squares of t = alpha + b * beta, weights 1/t^2 on the squared residuals.

    Args:
        points: [bytes, seconds, ...] rows (extra columns are ignored).

    Returns:
        (alpha seconds, beta seconds per byte).
    """
    points = [[b, t] for b, t, *_ in points]
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sb = sum(wi * b for wi, (b, _) in zip(w, points, strict=True))
    sbb = sum(wi * b * b for wi, (b, _) in zip(w, points, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sbt = sum(wi * b * t for wi, (b, t) in zip(w, points, strict=True))
    det = sw * sbb - sb * sb
    beta = (sw * sbt - sb * st) / det
    alpha = (st - beta * sb) / sw
    return alpha, beta


def robust_fit(
    points: list[list[float]], tolerance: float = 0.5
) -> tuple[float, float, list[bool]]:
    """`fit`, then refit without the points off by more than `tolerance` (relative), at most
    a third of them: a size whose p10 still met contention would tilt the line.

    Returns:
        (alpha, beta, used) where used[i] says whether point i is in the final fit.
    """
    alpha, beta = fit(points)
    errors = [abs(alpha + b * beta - t) / t for b, t, *_ in points]
    worst = sorted(range(len(points)), key=lambda i: -errors[i])[: len(points) // 3]
    used = [not (i in worst and errors[i] > tolerance) for i in range(len(points))]
    if all(used):
        return alpha, beta, used
    alpha, beta = fit([p for p, u in zip(points, used, strict=True) if u])
    return alpha, beta, used


def table(points: list[list[float]], used: list[bool], model: LoopbackModel) -> Table:
    """One row per size: measured and fitted one-way time, effective bandwidth."""
    t = Table(
        "Loopback ping-pong (gloo send/recv, 2 ranks): one-way time per message",
        ["size", "p10 us", "median us", "fitted us", "fit error", "effective GB/s"],
    )
    for (nbytes, secs, median), in_fit in zip(points, used, strict=True):
        pred = model.seconds(nbytes)
        t.rows.append(
            [
                fmt_bytes(nbytes) + ("" if in_fit else " (x)"),
                f"{secs * 1e6:.1f}",
                f"{median * 1e6:.1f}",
                f"{pred * 1e6:.1f}",
                f"{(pred - secs) / secs:+.0%}",
                f"{nbytes / secs / 1e9:.3f}",
            ]
        )
    t.notes = [
        f"fit t = alpha + bytes * beta: alpha = {model.alpha_s * 1e6:.1f} us, "
        f"1/beta = {model.bandwidth_gbps:.2f} GB/s (least squares on relative residuals of p10)",
        "one-way = half a round trip; p10 / median over the round trips of each size; the "
        "fit and the effective GB/s use p10 (contention for the cores only adds time)",
    ]
    if not all(used):
        t.notes.append("(x): left out of the fit (off by > 50% from the first fit: contention)")
    return t


def run(config: BenchConfig) -> str:
    """Measure, fit, save ``loopback.json`` / ``loopback.txt``; return the printed text."""
    sizes = QUICK_SIZES if config.quick else SIZES
    results = spawn(
        "bench.loopback:worker", 2, {"sizes": sizes, "quick": config.quick}, config.timeout_s
    )
    points: list[list[float]] = results[0]
    alpha, beta, used = robust_fit(points)
    info = host_info()
    model = LoopbackModel(alpha, beta, "gloo", info["host"])
    text = str(table(points, used, model))
    data = {
        **asdict(model),
        "bandwidth_gbps": model.bandwidth_gbps,
        "points": [
            {"bytes": int(b), "seconds": s, "median_s": m, "in_fit": u}
            for (b, s, m), u in zip(points, used, strict=True)
        ],
        "quick": config.quick,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: v for k, v in info.items() if k != "host"},
    }
    save_report(config.out_dir, "loopback", data, text)
    return text
