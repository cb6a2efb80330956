"""Smoke test of the ``checkpoint_transform`` benchmark (``--quick``: 4 -> 2 ranks, small weights).

Runs the real jobs (DCP save on 4 gloo ranks, DCP load + save on 2, shardwise's transform in
one process) and checks the table and the JSON: both sides hold the same values, every side
has a time, a rate and a peak. Never asserts a timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_checkpoint_transform_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.__main__ import main

    args = ["--quick", "--only", "checkpoint_transform", "--timeout", "100", "--out", str(tmp_path)]
    assert main(args) == 0
    text = (tmp_path / "checkpoint_transform.txt").read_text()
    for word in ("4 -> 2 ranks", "shardwise transform", "DCP load + save", "MB/s", "peak RSS"):
        assert word in text, word

    data = json.loads((tmp_path / "checkpoint_transform.json").read_text())
    assert data["match"] is True and data["src_ranks"] == 4 and data["dst_ranks"] == 2
    assert len(data["dcp"]) == 2 and len(data["shardwise"]["sums"]) == 2
    sides = [r["side"] for r in data["rows"]]
    assert sides == ["shardwise transform (1 process)", "DCP load (2 ranks)",
                     "DCP load + save (2 ranks)"]  # fmt: skip
    for r in data["rows"]:
        assert r["wall_s"] > 0 and r["mib_per_s"] > 0 and r["peak_bytes"] >= 0
