"""`redistribute` on 8 real gloo processes started by `shardwise run`: tuple-axis layouts and
device matrices with permuted rank lists give every rank the right block, issue the planned
collectives, and the gradients summed over ranks equal single-device autograd."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import run_job

HERE = Path(__file__).parent
WORKER = HERE / "redistribution_worker.py"
sys.path.insert(0, str(HERE))
from redistribution_worker import cases  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_redistribution_on_eight_real_processes(tmp_path: Path) -> None:
    names = [name for name, _, _ in cases(8)]
    run_job(WORKER, 8, tmp_path / "logs", timeout=150).assert_checks(8, names)
