"""Smoke test of ``python -m bench``: a quick 2-rank run writes sane tables and JSON.

`test_quick_run_writes_tables_and_json` runs the real harness (loopback fit + two
collectives, real gloo workers) in ``--quick`` mode and checks the files' fields, never a
timing. `test_fit_and_load_loopback_model` checks the least-squares fit and the JSON reader
in-process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_quick_run_writes_tables_and_json(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "--quick", "--ranks", "2", "--timeout", "60"]
    cmd += ["--only", "loopback,collectives"]  # the others have their own quick tests
    cmd += ["--collectives", "AllReduce,ReduceScatter", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=80)
    assert res.returncode == 0, res.stdout + res.stderr

    text = (tmp_path / "collectives.txt").read_text()
    for word in (
        "shardwise ms",
        "torch ms",
        "ratio",
        "lo torch/rank",
        "AllReduce",
        "ReduceScatter",
    ):
        assert word in text and word in res.stdout, word
    assert (tmp_path / "bench.txt").read_text().count("Loopback ping-pong") == 1

    rows = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert sorted(r["collective"] for r in rows) == ["AllReduce", "ReduceScatter"]
    for r in rows:
        assert r["world_size"] == 2 and r["match"] is True and not r["oversubscribed"]
        assert r["shardwise_s"] > 0 and r["torch_s"] > 0
        assert math.isclose(r["ratio"], r["shardwise_s"] / r["torch_s"])
        assert r["recorded_bytes"] == r["bound_bytes"]
        for lo in (r["lo_shardwise_bytes"], r["lo_torch_bytes"]):
            assert lo is None or lo > 0
    rs = next(r for r in rows if r["collective"] == "ReduceScatter")
    assert rs["bound_bytes"] == rs["size_bytes"] / 2  # (N-1)/N * S at N = 2

    model = json.loads((tmp_path / "loopback.json").read_text())
    assert model["backend"] == "gloo" and model["host"]
    assert math.isfinite(model["alpha_s"]) and math.isfinite(model["beta_s_per_byte"])
    assert len(model["points"]) >= 3
    compute = model["compute"]  # the cost model's calibration (shardwise.planner reads it)
    assert compute["flops_per_s"] > 0 and compute["op_s"] >= 0
    assert compute["optimizer_s_per_element"] >= 0 and compute["traffic_s_per_byte"] >= 0
    assert "collective" in model or "collective_points" in model


def test_fit_and_load_loopback_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.loopback import fit, load_loopback_model, robust_fit

    alpha, beta = 50e-6, 1 / 3e9
    points = [[float(b), alpha + b * beta, 0.0] for b in (8, 4096, 1 << 20, 16 << 20)]
    got = fit(points)
    assert math.isclose(got[0], alpha, rel_tol=1e-6) and math.isclose(got[1], beta, rel_tol=1e-6)

    outlier = [*points, [65536.0, 100 * (alpha + 65536 * beta), 0.0]]
    a, b, used = robust_fit(outlier)
    assert used == [True, True, True, True, False]
    assert math.isclose(a, alpha, rel_tol=1e-6) and math.isclose(b, beta, rel_tol=1e-6)

    path = tmp_path / "loopback.json"
    path.write_text(
        json.dumps({"alpha_s": a, "beta_s_per_byte": b, "backend": "gloo", "host": "h"})
    )
    model = load_loopback_model(path)
    assert math.isclose(model.bandwidth_gbps, 3.0, rel_tol=1e-6) and model.host == "h"
    assert "alpha 50.0 us" in str(model)


def test_collective_fit_prefers_a_per_call_cost_and_skips_oversubscribed_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fit_collectives` recovers call / alpha / beta from exact points, keeps the form with a
    call cost, fits only the N that do not exceed the cores (it reports the others), and with
    N = 2 alone takes the round's latency from the ping-pong."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.calibration import bytes_sent, fit_collectives, line_fit

    call, alpha, beta = 300e-6, 40e-6, 1e-9
    points = []
    for n in (2, 4):
        for kind in ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll"):
            for nbytes in (64, 65536, 4 << 20):
                rounds = 2 * (n - 1) if kind == "AllReduce" else n - 1
                t = call + rounds * alpha + bytes_sent(kind, nbytes, n) * beta
                points.append([kind, n, nbytes, t, t])
    got = fit_collectives(points, cores=4)
    assert got["form"] == "call + rounds + bytes" and got["fitted_ns"] == [2, 4]
    for key, want in (("call_s", call), ("alpha_s", alpha), ("beta_s_per_byte", beta)):
        assert math.isclose(got[key], want, rel_tol=1e-6), key
    slowed = [[k, n, b, t * (3 if n == 4 else 1), m] for k, n, b, t, m in points]
    two = fit_collectives(slowed, cores=2)  # N = 4 time-sliced: not fitted, still reported
    assert two["fitted_ns"] == [2] and math.isclose(two["call_s"], call, rel_tol=1e-3)
    assert math.isclose(two["forms"][two["form"]]["rms"][4], 2 / 3, rel_tol=1e-3)  # 3x slower
    pinned = fit_collectives(slowed, cores=2, round_s=alpha)  # N = 2 only: the ping-pong's round
    assert pinned["form"] == "call + ping-pong rounds + bytes" and pinned["alpha_s"] == alpha
    assert math.isclose(pinned["call_s"], call, rel_tol=1e-6)
    intercept, slope = line_fit([(x, 2e-6 + 3e-10 * x) for x in (8e3, 1.3e5, 2e6)])
    assert math.isclose(intercept, 2e-6, rel_tol=1e-6) and math.isclose(slope, 3e-10, rel_tol=1e-6)


def test_paired_ratio_median_and_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.harness import Measurement, paired_ratio

    # slow and fast repetitions of both candidates: the ratio of the medians (1.9 / 1.0 = 1.9)
    # is not the median of the ratios of each pair timed back to back (1.1)
    a = Measurement("a", seconds=[1.1, 2.2, 1.1, 4.4, 1.9])
    b = Measurement("b", seconds=[1.0, 2.0, 1.0, 4.0, 2.0])
    got = paired_ratio(a, b)
    assert got.median == pytest.approx(1.1) and got.low is None and got.high is None  # 5 < 6
    assert str(got) == "1.10"
    # 21 pairs with ratios 0.80, 0.81, ..., 1.00: the 95 % interval of the median is the 6th
    # to the 16th smallest (binomial(21, 1/2): P(count <= 5) = 0.0133, P(count <= 6) = 0.0392)
    ratios = [0.80 + i / 100 for i in range(21)]
    got = paired_ratio(Measurement("a", seconds=ratios[::-1]), Measurement("b", [1.0] * 21))
    assert (got.median, got.low, got.high) == pytest.approx((0.90, 0.85, 0.95))
    assert str(got) == "0.90 (0.85-0.95)"
    # 6 pairs: the smallest to the largest covers 1 - 2/64 = 96.9 %
    six = Measurement("a", [3.0, 1.0, 2.0, 6.0, 5.0, 4.0])
    got = paired_ratio(six, Measurement("b", [2.0] * 6))
    assert (got.low, got.high) == (0.5, 3.0)
