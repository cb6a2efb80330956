"""The loss's AllReduce, started at the end of the forward and finished when the loss can first
be read (after ``loss.backward()``, at an op on it, before an optimizer step, at the next
forward, at the end of the call), on 2 real gloo processes: every loss a train step reads or
returns and the parameters after it equal one device's (loss_overlap_worker.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from loss_overlap_worker import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_every_read_of_the_loss_matches_one_device_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, [step.__name__ for step in CASES])
