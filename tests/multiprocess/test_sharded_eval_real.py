"""`Model.eval` with the "loss" metric on a dataset sharded over 2 real gloo processes whose
last global batch is short (sharded_eval_worker.py, in the shared 2-rank job): equal to one
device's eval of the same global batches."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

pytestmark = pytest.mark.multiprocess


def test_sharded_eval_loss_equals_one_device_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, ["sharded_eval_loss"])
