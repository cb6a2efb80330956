"""Ranks whose annotations differ, on 2 real gloo processes (plan_agreement_worker.py): each
rank's plan is compared with rank 0's, and a rank whose planning failed tells the others, in
the store round of the first call's input check, so every rank raises a ValueError at once
instead of waiting in a collective until SHARDWISE_COMM_TIMEOUT (here 10 s) or failing with a
gloo "Connection closed by peer"."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_job

WORKER = Path(__file__).with_name("plan_agreement_worker.py")

pytestmark = pytest.mark.multiprocess


def test_ranks_planning_differently_all_raise_a_value_error(tmp_path: Path) -> None:
    job = run_job(WORKER, 2, tmp_path / "logs", timeout=120, env={"SHARDWISE_COMM_TIMEOUT": "10"})
    job.assert_checks(
        2, ["divergent-strategies", "one-rank-invalid-strategy", "same-strategies-after"]
    )
