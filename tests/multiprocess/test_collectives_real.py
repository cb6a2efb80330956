"""The collectives on real gloo processes started by `shardwise run`: forward values and
gradients equal single-process math on every rank (the simulated-world tests' ground truth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).with_name("real_collectives_worker.py")
CHECKS = [
    "AllReduce", "AllReduce-max", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll",
    "NeighborExchange", "NeighborExchange-shapes", "NeighborExchangeV2", "AllReduce-subgroup",
    "Buckets", "BufferPool",
]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_collectives_on_four_real_processes(tmp_path: Path) -> None:
    run_job(WORKER, 4, tmp_path / "logs", timeout=200).assert_checks(4, CHECKS)
