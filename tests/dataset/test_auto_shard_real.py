"""``num_shards="auto"`` on two real gloo processes started by `shardwise run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).with_name("auto_shard_worker.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_auto_shard_on_two_real_processes(tmp_path: Path) -> None:
    res = run_job(WORKER, 2, tmp_path / "logs", timeout=100, extra=("--join", "True"))
    logs = "".join(res.worker_log(r) for r in range(2))
    assert res.returncode == 0, res.output + logs
    for rank in range(2):
        assert "CHECK auto-shard OK" in res.worker_log(rank), logs
