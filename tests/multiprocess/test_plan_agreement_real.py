"""Ranks whose annotations differ, on 2 real gloo processes (plan_agreement_worker.py): each
rank's plan is compared with rank 0's, and a rank whose planning failed tells the others, in
the store round of the first call's input check, so every rank raises a ValueError at once
instead of waiting in a collective until SHARDWISE_COMM_TIMEOUT (here 10 s) or failing with a
gloo "Connection closed by peer". The job's last check, a partial last batch on rank 1 only,
fails the job with rank 1's ValueError (rank 0 kept its plan and waits in a collective)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardwise.testing import JobResult, run_job

WORKER = Path(__file__).with_name("plan_agreement_worker.py")
TIMEOUT_S = 10

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    logs = tmp_path_factory.mktemp("plan_agreement") / "logs"
    return run_job(WORKER, 2, logs, timeout=120, env={"SHARDWISE_COMM_TIMEOUT": str(TIMEOUT_S)})


def test_ranks_planning_differently_all_raise_a_value_error(job: JobResult) -> None:
    for rank in range(2):
        log = job.worker_log(rank)
        for name in ("divergent-strategies", "one-rank-invalid-strategy", "same-strategies-after"):
            assert f"CHECK {name} OK" in log, job.output + log


def test_a_rank_alone_planning_a_partial_last_batch_fails_the_job_naming_it(
    job: JobResult,
) -> None:
    """Rank 1 passes 3 rows where rank 0 passes 4 as before: rank 1 plans again, rank 0 does
    not (it waits in a collective); rank 1 raises a ValueError naming its shapes, rank 0 and
    the fix within SHARDWISE_COMM_TIMEOUT / 2 of planning, before rank 0's collective times out
    (before: rank 1 waited in the store and both ranks failed at the timeout, no shapes named),
    and the launcher's report names it."""
    err = job.output
    assert job.returncode == 1, err
    assert err.startswith("shardwise run: job failed: rank 1 failed first with exit code 1"), err
    said = err[err.index("ValueError: AutoParallel: rank 1 planned this call again") :]
    said = said.splitlines()[0]
    for what in (
        "for inputs of new shapes (args[0]: [3, 32])",
        f"; rank 0 did not within {TIMEOUT_S / 2:g} s",
        "raise SHARDWISE_COMM_TIMEOUT",
        "unequal rows in a last, partial batch",
        "as many rows on every rank",
        "drop_remainder=True",
        "DataLoader(drop_last=True)",
    ):
        assert what in said, said
    assert "Timed out waiting" not in err, err  # (rank 0 was stopped, not timed out)
    took = re.search(r"^UNEVEN ([\d.]+)$", job.worker_log(1), re.M)
    assert took is not None and float(took.group(1)) < TIMEOUT_S, job.worker_log(1)
