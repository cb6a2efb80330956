"""`redistribute` on 8 real gloo processes started by `shardwise run`: tuple-axis layouts and
device matrices with permuted rank lists give every rank the right block, issue the planned
collectives, and the gradients summed over ranks equal single-device autograd; the checks run
in the tests' one 8-process job (redistribution_worker.py, the ``eight_rank_job`` fixture)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

sys.path.insert(0, str(Path(__file__).parent))
from redistribution_worker import cases


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_redistribution_on_eight_real_processes(eight_rank_job: JobResult) -> None:
    eight_rank_job.assert_checks(8, [name for name, _, _ in cases(8)])
