"""Smoke test of the ``gpt_block`` benchmark (``--quick``, 2 ranks), and its bound.

`test_gpt_block_quick` runs the real 2-rank gloo job and checks the printed tables and the
saved JSON: shardwise, DTensor and one process give the same losses during the check steps,
every candidate was timed, both parallel candidates communicated at least the Megatron bound.
No timing is asserted. `test_megatron_bound` checks the bound's formula by hand, in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_gpt_block_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.__main__ import main

    args = ["--quick", "--ranks", "2", "--timeout", "50", "--only", "gpt_block"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "gpt_block.txt").read_text()
    for word in ("shardwise ms", "DTensor ms", "one process ms", "sw/DT", "bound", "colls DT"):
        assert word in text and word in printed, word

    data = json.loads((tmp_path / "gpt_block.json").read_text())
    assert data["meta"]["config"]["keep_prob"] == 1.0
    (row,) = data["rows"]
    assert (row["world_size"], row["dp"], row["mp"]) == (2, 1, 2) and row["equal"] is True
    assert max(row["diff_dtensor"], row["diff_single"], row["diff_dt_params"]) <= 1e-4
    assert len(row["losses"]) == 3 and all(3.5 < loss < 4.8 for loss in row["losses"])  # ~ln 64
    assert min(row["shardwise_s"], row["dtensor_s"], row["single_s"]) > 0
    # the paired ratio: a median, and no interval from the quick run's 2 repetitions
    median, low, high = row["sw_dt_ratio"]
    assert median > 0 and low is None and high is None
    # the bound is a minimum; neither side may beat it (shardwise: 6 AllReduce of activations)
    assert row["sw_bytes"] >= row["bound_bytes"] and row["dt_bytes"] >= row["bound_bytes"]
    assert row["sw_calls"].count("AllReduce(f)[4096]") == 3  # embedding, wo, fc2
    # the bound's collectives exactly: the train-step form skips the loss's backward
    # AllReduce, and equal gradients leave no bucket for the replicated parameters at 1 x 2
    assert row["sw_collectives"] == row["bound_collectives"] == 10
    assert row["dt_collectives"] >= 10 and "AllReduce" in row["dt_calls"]


def test_megatron_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.gpt_block import GLOBAL_BATCH, gpt_config, megatron_bound

    cfg = gpt_config(quick=True)  # vocab 64, seq 8, hidden 64, ffn 128
    t = GLOBAL_BATCH * cfg.seq  # 64 tokens
    act, logits, ids = t * 64 * 4, t * 32 * 4, t // 2 * 8
    # 6 AllReduce (2 (N-1)/N S = S at N=2) + 2 AlltoAll (S/2) + AllGather (S) + the loss (4 B)
    assert megatron_bound(cfg, GLOBAL_BATCH, 1, 2) == (6 * act + logits + ids + 4, 10)
    got, colls = megatron_bound(cfg, GLOBAL_BATCH, 2, 2)
    params = (64 * 64 + 4 * 64 * 64 + 64 * 128 + 128 + 128 * 64 + 64 * 64) // 2 + 8 * 64 + 4 * 64
    act2, logits2, ids2 = t // 2 * 64 * 4, t // 2 * 32 * 4, t // 4 * 8
    assert (got, colls) == (6 * act2 + logits2 + ids2 + 6 + params * 4, 11)
