"""Smoke test of the ``manual_dp``, ``dataloading`` and ``gpt2_semi_auto`` benchmarks
(``--quick``, 2 ranks).

`test_manual_dp_quick` runs the real 2-rank gloo job and checks the printed tables and the
saved JSON: parameters equal after the check steps, 3 shardwise collectives per step, recorded
bytes = the ring bound. `test_dataloading_quick` runs the 1-rank job on the synthetic IDX set
(``--quick`` always writes one) and checks the consistency checks and the shard arithmetic.
`test_gpt2_semi_auto_quick` runs the 2-rank job: shardwise's parameters equal DDP's after the
check steps, its returned loss equals DDP's after the loss's AllReduce, 2 collectives per step,
all three candidates timed. None asserts a timing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(
    name: str, out: Path, monkeypatch: pytest.MonkeyPatch, words: tuple[str, ...]
) -> dict[str, Any]:
    """Run benchmark `name` (``--quick``, 2 ranks); its saved table holds every one of
    `words`; returns its saved JSON."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.__main__ import main

    args = ["--quick", "--ranks", "2", "--timeout", "60", "--only", name, "--out", str(out)]
    assert main(args) == 0
    text = (out / f"{name}.txt").read_text()
    for word in words:
        assert word in text, word
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return data


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_manual_dp_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    words = ("shardwise ms", "DDP ms", "one process ms", "sw/DDP", "sw/one", "theory")
    (row,) = _run("manual_dp", tmp_path, monkeypatch, words)["rows"]
    printed = capsys.readouterr().out
    for word in words:
        assert word in printed, word

    assert row["world_size"] == 2 and row["equal"] is True
    assert row["diff_ddp"] <= 1e-5 and row["diff_single"] <= 1e-5
    assert row["collectives"] == 3  # loss forward + loss backward + one fused gradient bucket
    # (N = 2: every parameter byte, the reducer's 3 float32 counts a parameter, the loss twice)
    want = row["param_bytes"] + row["count_bytes"] + 8
    assert row["recorded_bytes"] == row["theory_bytes"] == want
    assert row["count_bytes"] == 3 * 4 * 6  # (three Linear layers: weights and biases)
    assert row["ddp_buckets"] in (None, 1, 2, 3)
    assert min(row["shardwise_s"], row["ddp_s"], row["single_s"]) > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_dataloading_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    words = ("torch per-sample", "torch batched", "shardwise sharded", "SYNTHETIC")
    data = _run("dataloading", tmp_path, monkeypatch, words)
    assert data["meta"]["checks"] == {"values": True, "shards": True}
    rows = {(r["pipeline"], r["workers"]): r for r in data["rows"]}
    assert len(rows) == 8
    for workers in (0, 2):
        whole, shard = rows[("shardwise", workers)], rows[("shardwise sharded", workers)]
        assert whole["rows"] == rows[("torch per-sample", workers)]["rows"] == 1024
        assert shard["rows"] * 4 == whole["rows"] and shard["batches"] == whole["batches"]
        assert all(r["epoch_s"] > 0 for r in data["rows"])


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_gpt2_semi_auto_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    words = ("shardwise s", "DDP s", "DDP+loss s", "an AllReduce of its loss")
    (row,) = _run("gpt2_semi_auto", tmp_path, monkeypatch, words)["rows"]
    assert row["world_size"] == 2 and row["max_diff"] <= 1e-6
    assert row["loss_diff"] <= 1e-5  # shardwise returns what DDP + the loss's AllReduce does
    assert row["collectives"] == 2  # one gradient bucket, the loss
    assert min(row["shardwise_s"], row["ddp_s"], row["ddp_loss_s"]) > 0
    # paired ratios: a median and no interval from the quick run's 2 repetitions
    assert row["ratio"][0] > 0 and row["ratio"][1:] == [None, None]
    assert row["ratio_loss"][0] > 0 and row["ratio_loss"][1:] == [None, None]
