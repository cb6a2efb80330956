"""The collectives on real gloo processes started by `shardwise run`: forward values and
gradients equal single-process math on every rank (the simulated-world tests' ground truth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import JobResult, run_job

CHECKS = [
    "AllReduce", "AllReduce-max", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll",
    "NeighborExchange", "NeighborExchange-shapes", "NeighborExchangeV2", "AllReduce-subgroup",
    "Buckets", "BufferPool",
]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_collectives_on_four_real_processes(four_rank_job: JobResult) -> None:
    four_rank_job.assert_checks(4, CHECKS)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_mismatched_inputs_fail_on_every_rank_under_detail_checks(tmp_path: Path) -> None:
    """docs/launcher.md's advice: torch's checking process groups work with shardwise's, and
    ReduceScatter / AlltoAll, whose shapes those do not compare, compare them themselves."""
    worker = Path(__file__).with_name("mismatch_worker.py")
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    checks = ["Mismatch", "Mismatch-ReduceScatter", "Mismatch-AlltoAll"]
    run_job(worker, 2, tmp_path / "logs", timeout=100, env=env).assert_checks(2, checks)
