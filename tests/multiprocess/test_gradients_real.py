"""Backwards other than ``loss.backward()`` on 2 real gloo processes (gradients_worker.py): a
backward from the output split over the ranks, a seed made from Python data (a plain tensor
in a simulated world, where it once went wrong while real jobs were right), and a wrapped
network's input gradient with the loss's backward after the call: one device's gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from gradients_worker import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_gradients_of_other_backwards_on_2_processes(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, [*CASES, "module_input_grad"])
