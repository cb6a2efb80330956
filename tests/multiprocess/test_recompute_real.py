"""Activation checkpointing on 2 real gloo processes (recompute_worker.py): the region's
recomputation replays the plan with the dropout masks drawn from each process's restored
generator state (`communication.draw_state` in a job), for data parallel and Megatron 1 x 2
with the region a whole block or only its column-parallel half, reentrant or not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.testing import JobResult

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from recompute_worker import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_checkpointed_blocks_with_dropout_match_one_device_on_2_processes(
    two_rank_job: JobResult,
) -> None:
    two_rank_job.assert_checks(2, [f"{mode}_{region}" for mode, region in CASES])
