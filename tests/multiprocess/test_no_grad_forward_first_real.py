"""A Megatron 1 x 2 train step that runs the network under ``torch.no_grad()`` or
``torch.inference_mode()`` before its training forward, on 2 real gloo processes
(no_grad_first_worker.py): the training forward moves the row-parallel bias again (the no-grad
move has no autograd link; under inference mode it was an inference tensor, which backward
refused to save), so the losses and the bias equal one device's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from no_grad_first_worker import MODES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_no_grad_forward_first_matches_one_device_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, [f"no_grad_first_{mode}" for mode in MODES])
