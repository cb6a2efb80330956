"""Loopback latency and bandwidth of gloo: a fitted cost model t = alpha + bytes * beta, and
the calibration of the planners' cost model on this machine.

- `worker` (runs on 2 ranks): ping-pong with ``dist.send`` / ``dist.recv`` for message sizes
  8 B .. 16 MiB; the one-way time of a size is half the median of its timed round trips.
- `fit` : least squares of t = alpha + bytes * beta on those points, weighted by 1/t so that
  the 8-byte and the 16-MiB points count alike (relative residuals).
- `run` : spawns the workers, fits, then calibrates (`bench.calibration`: compute on a 2-rank
  job, shardwise's collectives on 2 and 4 ranks, 2 only with ``--quick``), prints the tables
  and saves ``loopback.json`` ({"alpha_s", "beta_s_per_byte", "backend": "gloo", "host", ...,
  "collective": {"call_s", "alpha_s", "beta_s_per_byte", ...}, "compute": {"flops_per_s",
  "op_s", ...}}) and ``loopback.txt``.
- `load_loopback_model` : reads ``loopback.json`` back as a `LoopbackModel` (cost models
  outside ``bench/`` read the same JSON keys directly: `shardwise.planner.load_cost_model`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import calibration
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
    return calibration.line_fit([(b, t) for b, t, *_ in points])


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


def collective_table(points: list[list[Any]], fitted: dict[str, Any]) -> Table:
    """One row per collective, N and size: measured and fitted time per call."""
    forms = fitted["forms"]
    names = list(forms)
    t = Table(
        "Collectives (shardwise sw.ops, gloo): time per call in a step against the fitted forms",
        ["collective", "N", "block", "in step us", "back-to-back us", *[f"{n} us" for n in names]],
    )
    for kind, n, nbytes, secs, tight in points:
        row = [str(kind), f"{n}", fmt_bytes(nbytes), f"{secs * 1e6:.0f}", f"{tight * 1e6:.0f}"]
        for name in names:
            c = forms[name]["coefficients"]
            rounds = 2 * (n - 1) if kind == "AllReduce" else n - 1
            sent = calibration.bytes_sent(str(kind), int(nbytes), int(n))
            pred = c["call_s"] + rounds * c["alpha_s"] + sent * c["beta_s_per_byte"]
            row.append(f"{pred * 1e6:.0f} ({(pred - secs) / secs:+.0%})")
        t.rows.append(row)
    for name in names:
        f, c = forms[name], forms[name]["coefficients"]
        rms = ", ".join(f"N={n}: {v:.0%}" for n, v in f["rms"].items())
        beta = c["beta_s_per_byte"]
        bandwidth = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "n/a"
        t.notes.append(
            f"{name}: call {c['call_s'] * 1e6:.1f} us, alpha {c['alpha_s'] * 1e6:.1f} us per "
            f"round, 1/beta {bandwidth}; RMS relative residual "
            f"{rms}{'' if f['valid'] else ' (a negative coefficient: not used)'}"
        )
    fitted_ns = ", ".join(str(n) for n in fitted["fitted_ns"])
    why = (
        "at N = 2 a call has 1 or 2 rounds, too few to tell a per-call cost from a per-round "
        "one: the round is the ping-pong's one-way time"
        if fitted["form"] == calibration.PING_PONG_FORM
        else "the least RMS residual there with no negative term"
    )
    t.notes.append(
        f"fitted on N = {fitted_ns} (no more ranks than cores); kept: {fitted['form']} ({why})"
    )
    t.notes.append(
        "in step: what a call adds to a loop computing ~0.7 ms between calls (gloo's threads "
        "asleep, the ranks a little apart, as in a training step), the fit's input; "
        "back-to-back: a call in a tight loop of calls; both the 10th percentile of 7 "
        "repetitions of 16 calls (3 of 2 with --quick)"
    )
    return t


def compute_table(compute: dict[str, Any]) -> Table:
    """The compute constants of the cost model, with what each was measured on."""
    t = Table(
        f"Compute calibration (each of 2 ranks at once, {compute['threads_per_rank']} thread(s) "
        "each; the median over the ranks)",
        ["constant", "value", "measured on"],
    )
    rank0 = compute["ranks"][0]
    shapes = ", ".join(f"{r}x{k}x{n} {f / 1e9:.0f}" for r, k, n, f in rank0["matmul"])
    t.rows = [
        ["flops_per_s", f"{compute['flops_per_s'] / 1e9:.1f} GFLOP/s", f"F.linear: {shapes}"],
        [
            "op_s",
            f"{compute['op_s'] * 1e6:.1f} us",
            f"one more op in an AutoParallel train step ({compute['executor_op_s'] * 1e6:.1f}); "
            f"torch alone, forward + backward: {compute['torch_op_s'] * 1e6:.1f}",
        ],
        [
            "traffic_s_per_byte",
            f"{compute['traffic_s_per_byte'] * 1e12:.1f} ps/B",
            "layer_norm / gelu / mul chains, forward + backward, per byte read and written",
        ],
        [
            "optimizer_s_per_tensor",
            f"{compute['optimizer_s_per_tensor'] * 1e6:.1f} us",
            "AdamW step, per parameter",
        ],
        [
            "optimizer_s_per_element",
            f"{compute['optimizer_s_per_element'] * 1e9:.2f} ns",
            "AdamW step, per element",
        ],
    ]
    return t


def run(config: BenchConfig) -> str:
    """Measure, fit, calibrate, save ``loopback.json`` / ``loopback.txt``; return the printed
    text."""
    sizes = QUICK_SIZES if config.quick else SIZES
    results = spawn(
        "bench.loopback:worker", 2, {"sizes": sizes, "quick": config.quick}, config.timeout_s
    )
    points: list[list[float]] = results[0]
    alpha, beta, used = robust_fit(points)
    info = host_info()
    model = LoopbackModel(alpha, beta, "gloo", info["host"])
    coll_sizes = (
        calibration.QUICK_COLLECTIVE_SIZES if config.quick else calibration.COLLECTIVE_SIZES
    )
    args = {"quick": config.quick, "sizes": coll_sizes}
    calibrated = spawn("bench.calibration:worker", 2, args, config.timeout_s)
    compute = calibration.combine_compute([r["compute"] for r in calibrated])
    coll_points: list[list[Any]] = calibrated[0]["collectives"]
    if not config.quick:
        coll_points += spawn("bench.calibration:collectives_worker", 4, args, config.timeout_s)[0]
    fitted = calibration.fit_collectives(coll_points, int(info["cpu_count"]), alpha)
    tables = [table(points, used, model), collective_table(coll_points, fitted)]
    text = "\n\n".join(str(t) for t in (*tables, compute_table(compute)))
    data = {
        **asdict(model),
        "bandwidth_gbps": model.bandwidth_gbps,
        "points": [
            {"bytes": int(b), "seconds": s, "median_s": m, "in_fit": u}
            for (b, s, m), u in zip(points, used, strict=True)
        ],
        "collective": {**fitted, "points": coll_points},
        "compute": compute,
        "quick": config.quick,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: v for k, v in info.items() if k != "host"},
    }
    if fitted["form"] is None:  # no usable fit: the cost model keeps the ping-pong's
        del data["collective"]
        data["collective_points"] = coll_points
    save_report(config.out_dir, "loopback", data, text)
    return text
