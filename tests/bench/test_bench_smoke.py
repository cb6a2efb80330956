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
