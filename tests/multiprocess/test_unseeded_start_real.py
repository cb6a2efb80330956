"""A script that never seeds torch, on 2 real gloo processes (unseeded_start_worker.py):
``init()`` gives every rank rank 0's torch random state, so a network built after it has the
same weights on every rank, and an unseeded sharded dataset takes the constant default seed on
every rank: its shards are disjoint and cover it."""

from __future__ import annotations

import pytest

from shardwise.testing import JobResult

pytestmark = pytest.mark.multiprocess


def test_an_unseeded_job_starts_alike_on_every_rank(two_rank_job: JobResult) -> None:
    two_rank_job.assert_checks(2, ["unseeded_weights_alike", "unseeded_shards_disjoint"])
