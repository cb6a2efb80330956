"""Smoke test of the ``operator_parallel`` benchmark (``--quick``, 2 ranks).

Runs the real 2-rank gloo job and checks the printed tables and the saved JSON: shardwise,
DTensor and one process give the same losses during the check steps, every candidate was timed,
both parallel candidates communicated and the byte columns are consistent. No timing is
asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
W1_BYTES = 28 * 28 * 512 * 4  # replicated at N = 2: its gradient is all-reduced


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_operator_parallel_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.__main__ import main

    args = ["--quick", "--ranks", "2", "--timeout", "60", "--only", "operator_parallel"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "operator_parallel.txt").read_text()
    for word in ("shardwise ms", "DTensor ms", "one process ms", "sw/DT", "overhead ms", "lo DT"):
        assert word in text and word in printed, word

    data = json.loads((tmp_path / "operator_parallel.json").read_text())
    (row,) = data["rows"]
    assert row["world_size"] == 2 and row["mesh"] == "2" and row["equal"] is True
    assert max(row["diff_dtensor"], row["diff_single"], row["diff_dt_params"]) <= 1e-5
    assert len(row["losses"]) == 3 and all(2.0 < loss < 2.6 for loss in row["losses"])
    assert min(row["shardwise_s"], row["dtensor_s"], row["single_s"], row["local_s"]) > 0
    # the paired ratio: a median, and no interval from the quick run's 2 repetitions
    median, low, high = row["sw_dt_ratio"]
    assert median > 0 and low is None and high is None
    assert row["sw_fwd_bytes"] > 0 and row["sw_collectives"] >= 3
    assert row["sw_bwd_bytes"] >= W1_BYTES and row["dt_bytes"] >= W1_BYTES  # 2(N-1)/N = 1
    assert row["dt_collectives"] >= 3 and "AllReduce" in row["dt_calls"]
