"""Smoke test of the ``optimizer_parallel`` benchmark (``--quick``, 2 ranks), and its formulas.

`test_optimizer_parallel_quick` runs the real 2-rank gloo jobs (one timing job with both
networks, one fresh-process memory job) and checks the printed tables and the saved JSON: every
candidate's losses equal DDP's during the check steps, every candidate was timed, the byte and
collective columns are consistent with the bounds. No timing is asserted.
`test_formulas` checks the bound and the model-state theory by hand, in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MLP_PARAMS = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10  # 669,706


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_optimizer_parallel_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.__main__ import main
    from bench.optimizer_parallel import BASELINES, CANDIDATES, CHECK_RTOL, SW

    args = ["--quick", "--ranks", "2", "--timeout", "50", "--only", "optimizer_parallel"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "optimizer_parallel.txt").read_text()
    words = (
        "/best base",
        "/DDP",
        "cpu ms",
        "sent/bound",
        "peak RSS",
        "loss rel diff",
        "FSDP2 zero3",
    )
    for word in words:
        assert word in text and word in printed, word

    rows = json.loads((tmp_path / "optimizer_parallel.json").read_text())["rows"]
    assert [(r["model"], r["name"]) for r in rows] == [
        (m, c) for m in ("mlp", "wide") for c in CANDIDATES
    ]
    by = {(r["model"], r["name"]): r for r in rows}
    for r in rows:
        assert r["world_size"] == 2 and r["step_s"] > 0, r["name"]
        assert 0 < r["cpu_s"] < 20 * r["step_s"], r["name"]  # this process's threads only
        assert r["loss_rel_diff"] <= CHECK_RTOL and len(r["losses"]) == 3, r["name"]
        # the bound is a minimum (the loss's backward needs no all-reduce: loss.backward());
        # level 3 may send less: a weight autograd does not save (the first layer's: its input
        # needs no gradient) is not gathered again, so its floor is levels 1-2's 2(N-1)/N P
        low = by[r["model"], "sw level1"]["bound"] if r["name"] == "sw level3" else r["bound"]
        assert low <= r["bytes_sent"] <= r["bound"] * 1.01, r["name"]
        assert (r["comm_s"] is not None) == (r["name"] in SW)
    assert all(2.0 < loss < 2.6 for loss in by["mlp", "DDP"]["losses"])  # ~ln 10
    assert by["mlp", "sw level1"]["param_bytes"] == MLP_PARAMS * 4
    # N = 2, one fusion bucket per Linear (3): a gather and a reduce-scatter each, the loss's
    # forward all-reduce (level 3: and the backward re-gathers of the 2 layers whose weight
    # autograd saved: not the first, its input needs no gradient)
    for name, count in (("sw level1", 7), ("sw level2", 7), ("sw level3", 9)):
        assert by["mlp", name]["collectives"] == count, name
    assert "ReduceScatter(s)" in by["mlp", "sw level1"]["calls"]  # level 1: at the step
    assert "ReduceScatter(b)" in by["mlp", "sw level2"]["calls"]  # level 2: in backward
    assert by["mlp", "sw level3"]["calls"].count("AllGather") == 5
    # one 25 MB gradient bucket (the 6 per-parameter AllReduces are one bucket now) + the loss
    # (forward only)
    assert by["mlp", "sw dp"]["collectives"] == 2
    for name in BASELINES:
        assert by["mlp", name]["calls"].endswith("AllReduce[1]"), name  # the loss value
    assert "Broadcast" in by["mlp", "DDP+ZeRO-1"]["calls"]
    assert "ReduceScatter" in by["mlp", "FSDP2 zero2"]["calls"]
    # memory: --quick measures one configuration (wide, sw level3) in a fresh job
    measured = [r for r in rows if r["rss_peak"] is not None]
    assert [(r["model"], r["name"]) for r in measured] == [("wide", "sw level3")]
    # (growth is the peak above the peak before building: the quick model is small enough
    # that the imports' peak can be the higher one, so 0 is a valid reading)
    assert measured[0]["rss_peak"] > measured[0]["rss_growth"] >= 0


def test_formulas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.optimizer_parallel import bound_bytes, param_count, state_bytes

    assert param_count("mlp", quick=False) == MLP_PARAMS
    d, f = 1024, 4096
    assert param_count("wide", quick=False) == 2 * (2 * d * f + f + d) + d * 10 + 10
    p, n = 4000, 4
    loss = 2 * 3 * 4 // 4  # AllReduce of 4 bytes over 4 ranks
    assert bound_bytes("DDP", p, n) == bound_bytes("sw dp", p, n) == 2 * 3 * p // 4 + loss
    assert bound_bytes("sw level1", p, n) == bound_bytes("FSDP2 zero2", p, n) == 6000 + loss
    assert bound_bytes("sw level3", p, n) == bound_bytes("FSDP2 zero3", p, n) == 9000 + loss
    assert bound_bytes("DDP+ZeRO-1", p, n) == 9000 + loss
    assert state_bytes("DDP", p, n) == 4 * p and state_bytes("sw level3", p, n) == p
    assert state_bytes("sw level1", p, n) == state_bytes("DDP+ZeRO-1", p, n) == 2 * p + p // 2
    assert state_bytes("sw level2", p, n) == state_bytes("FSDP2 zero2", p, n) == p + 3 * p // 4
